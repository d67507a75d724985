"""The push prepare step is vLLM's ``MoonEPPrepareAndFinalize.prepare`` with one hook (vllm/prepare_finalize/push.py).

The push class runs vLLM's ``prepare`` unchanged; its ``_resolve_weight_layout`` (the layout must be the
push one) wraps the step's buffer in ``PushPrefetch``, so vLLM's next statement, ``self._buffer.
prefetch_weight(plan=plan, full_*_weight=weight_layout.full_*_weight)``, becomes the push call with the
layout's push arguments. That holds only while vLLM's ``prepare`` has that shape, so:

* :func:`test_vllm_prepare_has_the_shape_the_push_hook_relies_on` reads vLLM's ``prepare`` in the
  ``vllm==0.33.0`` environment (``inspect.getsource``, ``inspect.signature``) and checks the facts
  (:func:`hook_problems`): its parameters, one ``self._buffer.prefetch_weight`` call with exactly the
  keywords the hook translates, fed from the layout that the statement before resolved, after every choice
  of ``self._buffer``, and a digest of the method (and of ``_resolve_weight_layout``, which the hook
  extends), so any other change in vLLM flags it too, saying what to re-check;
* :func:`test_the_pin_flags_a_changed_prepare` is its positive control, on modified copies of that source;
* :func:`test_push_prepare_runs_vllms_prepare_with_the_push_prefetch` runs the push class on one process
  with a recording buffer: what vLLM's ``prepare`` hands the buffer through the hook, the refusals, the
  runtime guards under stand-ins for a drifted ``prepare``, the class the pool's ``api`` picks.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import textwrap
import tokenize
from typing import Any

import pytest

from tests.support.vllm_envs import run_json

pytestmark = pytest.mark.slow

#: Digests (:func:`code_digest`) of vLLM 0.33.0's methods the push hook runs: ``prepare`` (whose prefetch call
#: it translates) and ``_resolve_weight_layout`` (which it extends).
PINNED_DIGESTS = {"prepare": "b8bb349cbeab5d8d749f09e42b99f260c8e7a240b4377e7b00131db13452f658",
                  "_resolve_weight_layout": "c66a058dacb238ecee7271712eff2afc2a554b1d8e1b4a41834a50db890f8f0f"}
#: ``prepare``'s parameters: ``(name, kind, default)``; the push class declares the same.
PINNED_PARAMETERS = [["self", "POSITIONAL_OR_KEYWORD", None], ["a1", "POSITIONAL_OR_KEYWORD", None],
                     ["topk_weights", "POSITIONAL_OR_KEYWORD", None], ["topk_ids", "POSITIONAL_OR_KEYWORD", None],
                     ["num_experts", "POSITIONAL_OR_KEYWORD", None], ["expert_map", "POSITIONAL_OR_KEYWORD", None],
                     ["apply_router_weight_on_input", "POSITIONAL_OR_KEYWORD", None],
                     ["quant_config", "POSITIONAL_OR_KEYWORD", None],
                     ["defer_input_quant", "POSITIONAL_OR_KEYWORD", "False"]]
#: The keywords of vLLM's prefetch call that PushPrefetch translates (push.PULL_KEYWORDS, plus ``plan``).
PREFETCH_KEYWORDS = {"plan", "full_gate_weight", "full_up_weight", "full_down_weight"}
RECHECK = ("re-check src/moonep_ep/vllm/prepare_finalize/push.py (PushPrefetch, MoonEPPushPrepareAndFinalize."
           "_resolve_weight_layout and prepare) against vLLM's MoonEPPrepareAndFinalize.prepare: the push hook "
           "needs one self._buffer.prefetch_weight(plan=, full_gate_weight=, full_up_weight=, full_down_weight=) "
           "call fed from the layout self._resolve_weight_layout() returned in the statement just before, after "
           "the step's buffer is chosen (pool, padding); nothing in prepare may assume [E+B] groups (the push "
           "path's cu_seqlens is [2*epn]) or fewer than S dispatched tokens; push.py's own refusals (bf16, the "
           "push layout) must still come first. Then update the pins in tests/vllm/test_push_prepare.py")


def code_digest(source: str) -> str:
    """sha256 of a function's tokens: comments and formatting do not count, any code change does (tokens, not
    ``ast.dump``: the same digest whichever Python reads it)."""
    marks = {tokenize.INDENT: "<indent>", tokenize.DEDENT: "<dedent>", tokenize.NEWLINE: "<newline>"}
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER}
    tokens = [marks.get(t.type, t.string) for t in tokenize.generate_tokens(io.StringIO(textwrap.dedent(source))
                                                                         .readline) if t.type not in skip]
    return hashlib.sha256(" ".join(tokens).encode()).hexdigest()


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def _calls(node: ast.AST, attr: str) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == attr]


def hook_problems(sources: dict[str, str], parameters: list) -> list[str]:
    """What in vLLM's ``prepare`` (``sources``: the methods' source; ``parameters``: ``prepare``'s) differs
    from what the push hook relies on; ``[]`` when nothing does."""
    problems = []
    if parameters != PINNED_PARAMETERS:
        problems.append(f"prepare's parameters changed: {parameters} (pinned {PINNED_PARAMETERS}); the push "
                        "class's prepare must take the same")
    fn = ast.parse(textwrap.dedent(sources["prepare"])).body[0]
    body = fn.body
    prefetch = _calls(fn, "prefetch_weight")
    resolve = [c for c in _calls(fn, "_resolve_weight_layout") if _is_self_attr(c.func, "_resolve_weight_layout")]
    if len(prefetch) != 1:
        problems.append(f"prepare makes {len(prefetch)} prefetch_weight calls, not one")
    if len(resolve) != 1:
        problems.append(f"prepare calls self._resolve_weight_layout() {len(resolve)} times, not once")
    if len(prefetch) == 1 and len(resolve) == 1:
        call = prefetch[0]
        names = [k.arg for k in call.keywords]
        if not _is_self_attr(call.func.value, "_buffer"):
            problems.append(f"the prefetch_weight call is made on {ast.unparse(call.func.value)}, not self._buffer")
        if call.args or None in names or set(names) != PREFETCH_KEYWORDS:
            problems.append(f"the prefetch_weight call passes {ast.unparse(call)}; the hook translates exactly "
                            f"the keywords {sorted(PREFETCH_KEYWORDS)}")
        at = [i for i, s in enumerate(body) if any(n is resolve[0] for n in ast.walk(s))]
        stmt = body[at[0]] if at else None
        if not (isinstance(stmt, ast.Assign) and stmt.value is resolve[0] and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)):
            problems.append("self._resolve_weight_layout() is not a statement of prepare's body of the form "
                            "`name = self._resolve_weight_layout()`")
        else:
            layout = stmt.targets[0].id
            following = body[at[0] + 1] if at[0] + 1 < len(body) else None
            if not (isinstance(following, ast.Expr) and following.value is call):
                problems.append("the prefetch_weight call is not the statement right after the layout's resolution")
            for k in call.keywords:
                if k.arg != "plan" and not (isinstance(k.value, ast.Attribute) and k.value.attr == k.arg
                                            and isinstance(k.value.value, ast.Name) and k.value.value.id == layout):
                    problems.append(f"prefetch_weight's {k.arg}= is {ast.unparse(k.value)}, not {layout}.{k.arg}")
            for s in body[at[0]:]:
                for n in ast.walk(s):
                    chooses = (isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and any(
                        _is_self_attr(t, "_buffer") or (isinstance(t, ast.Tuple) and any(
                            _is_self_attr(e, "_buffer") for e in t.elts))
                        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])))
                    chooses = chooses or (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                                          and n.func.attr in ("_pad_to_capacity", "get")
                                          and (_is_self_attr(n.func, "_pad_to_capacity")
                                               or _is_self_attr(n.func.value, "buffer_pool")))
                    if chooses:
                        problems.append(f"the step's buffer is chosen after the layout's resolution: "
                                        f"{ast.unparse(n)}")
    for name, pinned in PINNED_DIGESTS.items():
        got = code_digest(sources[name])
        if got != pinned:
            problems.append(f"MoonEPPrepareAndFinalize.{name} changed (digest {got}, pinned {pinned})")
    return problems


@functools.lru_cache(maxsize=1)
def _collected() -> dict[str, Any]:
    return run_json("vllm", ["-m", "tests.support.push_prepare_check"], timeout=400)


def test_vllm_prepare_has_the_shape_the_push_hook_relies_on(report):
    out = _collected()
    vllm = out["vllm"]
    problems = hook_problems(vllm, vllm["parameters"])
    assert problems == [], "\n".join(["vLLM's prepare is not the one the push hook was checked against:",
                                      *problems, f"Fix: {RECHECK}"])
    assert out["push_parameters"] == vllm["parameters"], "the push class's prepare must take vLLM's parameters"
    digests = ", ".join(f"{k} {v[:12]}" for k, v in PINNED_DIGESTS.items())
    report(f"[push hook] vLLM's prepare: one self._buffer.prefetch_weight({', '.join(sorted(PREFETCH_KEYWORDS))}) "
           f"right after the layout's resolution; digests {digests}")


def _mutate(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, f"positive control: {old!r} is not once in vLLM's prepare"
    return source.replace(old, new)


def test_the_pin_flags_a_changed_prepare():
    """Positive controls: the check fails on modified copies of vLLM's source, naming what changed."""
    vllm = _collected()["vllm"]
    source, params = vllm["prepare"], vllm["parameters"]

    def problems(src: str = source, parameters: list = params) -> list[str]:
        return hook_problems({**vllm, "prepare": src}, parameters)

    assert problems() == []
    # comments and formatting are not code: nothing flags
    assert problems(_mutate(source, "        weight_layout = self._resolve_weight_layout()\n",
                            "        # a comment\n        weight_layout = self._resolve_weight_layout(  )\n")) == []
    digest = "MoonEPPrepareAndFinalize.prepare changed"
    # a keyword the hook does not translate
    renamed = problems(_mutate(source, "full_gate_weight=weight_layout.full_gate_weight",
                               "full_w13_weight=weight_layout.full_gate_weight"))
    assert any("the hook translates exactly the keywords" in p for p in renamed) and any(digest in p for p in renamed)
    extra = problems(_mutate(source, "            plan=plan,\n",
                             "            plan=plan,\n            async_finish=True,\n"))
    assert any("async_finish=True" in p for p in extra)
    # a second prefetch call
    twice = problems(_mutate(source, "        # Segment sizes", "        self._buffer.prefetch_weight(plan=plan)\n"
                                                              "        # Segment sizes"))
    assert any("2 prefetch_weight calls" in p for p in twice)
    # the step's buffer chosen again between the resolution and the prefetch
    between = problems(_mutate(source, "        weight_layout = self._resolve_weight_layout()\n",
                               "        weight_layout = self._resolve_weight_layout()\n"
                               "        capacity, self._buffer = self.buffer_pool.get(num_tokens)\n"))
    assert any("not the statement right after" in p for p in between)
    assert any("the step's buffer is chosen after the layout's resolution" in p for p in between)
    # the layout resolved before the pool's choice
    early = problems(_mutate(_mutate(source, "        weight_layout = self._resolve_weight_layout()\n", ""),
                             "        num_tokens = a1.shape[0]\n",
                             "        weight_layout = self._resolve_weight_layout()\n"
                             "        num_tokens = a1.shape[0]\n"))
    assert any("not the statement right after" in p for p in early)
    assert any("chosen after the layout's resolution" in p for p in early)
    # other tensors than the layout's
    other = problems(_mutate(source, "full_up_weight=weight_layout.full_up_weight",
                             "full_up_weight=weight_layout.full_up_weight.clone()"))
    assert any("full_up_weight= is weight_layout.full_up_weight.clone()" in p for p in other)
    # a change elsewhere (the [E+B] groups assumed): only the digest sees it, and says what to re-check
    elsewhere = problems(_mutate(source, "minlength=num_experts,", "minlength=num_experts + 4,"))
    assert len(elsewhere) == 1 and digest in elsewhere[0]
    # _resolve_weight_layout changed
    resolved = hook_problems({**vllm, "_resolve_weight_layout": vllm["_resolve_weight_layout"] + "    pass\n"}, params)
    assert resolved and "MoonEPPrepareAndFinalize._resolve_weight_layout changed" in resolved[0]
    # a parameter added
    assert "prepare's parameters changed" in problems(parameters=params + [["x", "KEYWORD_ONLY", "None"]])[0]


def test_push_prepare_runs_vllms_prepare_with_the_push_prefetch():
    run = _collected()["run"]
    epn = 2
    push = ["down_prefetch_buffer", "gate_prefetch_buffer", "local_down_weight", "local_gate_weight",
            "local_up_weight", "up_prefetch_buffer"]
    scales = ["down_scale_prefetch_buffer", "gate_scale_prefetch_buffer", "local_down_scale", "local_gate_scale",
              "local_up_scale", "up_scale_prefetch_buffer"]
    for name, keywords in (("bf16", push), ("quantized", sorted(push + scales))):
        step = run[name]
        assert step["class"] == "MoonEPPushPrepareAndFinalize"
        # exactly S tokens dispatched (5 real, padded to the pool's 128), then the one push call with the
        # layout's own tensors (identity), the dispatch's plan, blocking (the plugin's buffer asks async)
        assert step["log"] == [["dispatch", [128, 128], [128, 2], 256], ["prefetch_weight", True, False, keywords]]
        assert step["prefetched_is_layouts"] and step["num_tokens"] == 5
        # cu_seqlens [2*epn] -> 2*epn group sizes, vLLM's code unchanged
        assert step["groups"] == 2 * epn and step["counts"] == [3, 5, 0, 2]
        assert step["result_shape"] == [[256, 128], None, None, [256]]
        # the pool's buffer, not the hook, is what finalize (vLLM's combine) and the plugin's readers get
        assert step["buffer_after_prepare_is_the_pools"]
        assert step["after_finalize"] == {"log_tail": ["combine", True], "plan_cleared": True,
                                          "output_rows_from_combine": True}
    # the plugin's padding swapping the step's buffer (a larger capacity): the hook wraps the swapped one
    assert run["swapped"] == {"first_log": [], "swapped_ops": ["dispatch", "prefetch_weight"],
                              "buffer_after_prepare_is_swapped": True}
    assert run["fp16"]["log"] == [] and run["fp16"]["error"].startswith(
        "ConfigError: moonep_ep: MoonEP's push path dispatches bf16 activations only (got torch.float16")
    assert run["pull_layout"]["error"].startswith("ConfigError: moonep_ep: the push prepare step got a "
                                                  "MoonEPExpertWeightLayout ([E+B] pull views)")
    assert run["pull_layout"]["ops"] == ["dispatch"] and run["pull_layout"]["buffer_restored"]
    # the runtime guards: a drifted prepare fails loudly, the buffer handed back either way
    guards = run["guards"]
    assert guards["as_vllm_calls_it"] == {"error": "no error", "prefetches": 1, "buffer_restored": True}
    for case, prefetches, tail in (("no_prefetch", 0, "The hook saw 0 prefetch calls"),
                                   ("no_layout_resolution", 0, "The hook saw no layout resolution"),
                                   ("extra_keyword", 0, "Got prefetch_weight keywords ['async_finish', "),
                                   ("other_tensors", 0, "Got prefetch_weight keywords ['full_down_weight', "),
                                   ("two_prefetches", 2, "The hook saw 2 prefetch calls")):
        g = guards[case]
        assert g["error"].startswith("RuntimeError: moonep_ep: vLLM's MoonEPPrepareAndFinalize.prepare no longer "
                                     "has the shape the push hook relies on"), (case, g)
        assert tail in g["error"] and "tests/vllm/test_push_prepare.py" in g["error"], (case, g)
        assert (g["prefetches"], g["buffer_restored"]) == (prefetches, True), (case, g)
    # the pool's `api` attribute picks the class; its former name is no longer read
    assert run["chosen"] == {"push": "MoonEPPushPrepareAndFinalize", "pull": "MoonEPPrepareAndFinalize",
                             "None": "MoonEPPrepareAndFinalize", "moonep_api=push": "MoonEPPrepareAndFinalize"}


def test_the_prepare_counts_experts_on_the_device_once_patched():
    """vLLM's ``prepare`` counts MoonEP's ``tokens_per_expert`` with ``torch.bincount`` (a device round trip on
    GPUs: it reads the ids' maximum); the plugin's ``counting.count_on_device`` makes it a scatter-add. Same
    counts as ``bincount`` of the ids the dispatch receives, int32 as MoonEP takes them; the control is the
    unpatched run, which does call ``bincount``; the prepare's digest pin above covers the call it relies on."""
    got = _collected()["run"]["counting"]
    assert got["before"]["bincount_ran"] and not got["before"]["index_add_ran"]   # the control
    assert got["after"]["index_add_ran"] and not got["after"]["bincount_ran"]
    for run in (got["before"], got["after"]):
        assert run["counts_equal_bincount"] and run["dtype"] == "torch.int32"
    assert got["after"]["counts"] == got["before"]["counts"] and sum(got["after"]["counts"]) == 128 * 2  # S * K there
    assert got["patched_now"] and not got["patched_twice"] and got["module_torch_is_the_counting_one"]
