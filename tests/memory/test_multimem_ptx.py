"""The multimem store kernel is valid PTX for sm_90, checked by the CUDA toolkit's assembler
where one is installed (no GPU needed). Not an emulator test: the emulator only parses the
PTX's signature; ``ptxas`` proves the instruction stream itself."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from moonep_ep.memory import multimem


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not installed")
def test_the_multimem_ptx_assembles_for_sm90(tmp_path):
    """The kernel text is valid PTX for sm_90 (where multimem starts); a broken variant is not."""
    good, bad = tmp_path / "good.ptx", tmp_path / "bad.ptx"
    good.write_text(multimem.PTX)
    bad.write_text(multimem.PTX.replace(".v4.f32 [%rd9]", ".v4.b32 [%rd9]"))  # ptxas refuses v4 .b32
    ok = subprocess.run(["ptxas", "-arch=sm_90", str(good), "-o", str(tmp_path / "good.cubin")],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    broken = subprocess.run(["ptxas", "-arch=sm_90", str(bad), "-o", str(tmp_path / "bad.cubin")],
                            capture_output=True, text=True)
    assert broken.returncode != 0 and "multimem.st" in broken.stderr
