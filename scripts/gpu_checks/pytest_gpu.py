"""The GPU-marked tests this machine can run, none of which may skip (scripts/gpu_check.sh part 1).

``python3 scripts/gpu_checks/pytest_gpu.py OUT GPUS``: runs ``pytest -m cuda`` (plus ``multi_gpu`` with
>= 2 GPUs, ``nvswitch`` when multicast is supported) over the memory and layout tiers (the vLLM tier's
GPU test needs vLLM's engine: part 4), then prints one JSON line: tests, skipped, failures, ok.

``python3 scripts/gpu_checks/pytest_gpu.py OUT GPUS NAME PATH...``: ``pytest -m cuda`` over the given files
only (the one-GPU command's ``push_layout`` and ``quantized_vmm`` steps), its report ``OUT/NAME.xml``; the
JSON line also names each test's outcome.
"""

import json
import subprocess
import sys
import xml.etree.ElementTree as ET


def _outcome(case: ET.Element) -> str:
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            return {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
    return "passed"


def main() -> int:
    out_dir, gpus = sys.argv[1], int(sys.argv[2])
    name, paths = (sys.argv[3], sys.argv[4:]) if len(sys.argv) > 4 else ("gpu-tests", None)
    marks = "cuda and not multi_gpu and not nvswitch"
    if paths:
        marks = "cuda"
    elif gpus >= 2:
        marks = "cuda or multi_gpu"
        probe = subprocess.run([sys.executable, "-m", "moonep_ep", "check", "--json"], capture_output=True, text=True)
        try:
            if json.loads(probe.stdout)["cuda"].get("multicast"):
                marks = "cuda or multi_gpu or nvswitch"
        except (ValueError, KeyError):
            pass
    junit = f"{out_dir}/{name}.xml"
    rc = subprocess.run([sys.executable, "-m", "pytest", "-m", marks, "-q", "-rs", "-p", "no:cacheprovider",
                         f"--junitxml={junit}",
                         *(paths or ["tests/memory", "tests/layout", "tests/ops", "tests/cli"])]).returncode
    try:
        root = ET.parse(junit).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
        failures = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        outcomes = {case.get("name"): _outcome(case) for case in suite.iter("testcase")}
    except (OSError, ET.ParseError, AttributeError) as exc:
        print(json.dumps({"ok": False, "error": f"no junit report: {exc}", "rc": rc}))
        return 1
    ok = rc == 0 and tests > 0 and skipped == 0 and failures == 0
    report = {"ok": ok, "marks": marks, "tests": tests, "skipped": skipped, "failures": failures, "rc": rc}
    if paths:
        report.update(paths=paths, outcomes=outcomes)
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
