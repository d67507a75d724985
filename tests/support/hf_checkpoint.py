"""A checkpoint directory written by HuggingFace transformers itself, not by this project's builders.

``python -m tests.support.hf_checkpoint ARCH OUT_DIR`` builds a small random
model of architecture ``ARCH`` with transformers' ``from_config`` and writes
it with ``save_pretrained`` (its own file layout, parameter names and
``config.json``), plus a ``PreTrainedTokenizerFast`` over the offline
WordLevel vocabulary saved the same way: what ``vllm-demo --model PATH`` is
tested on. Needs transformers (the vLLM environments have it).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

COMMON = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False, rms_norm_eps=1e-6)

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "mixtral": dict(model_type="mixtral", num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=128),
    "qwen3_moe": dict(model_type="qwen3_moe", num_key_value_heads=2, head_dim=64, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=128, intermediate_size=512,
                      decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
    "olmoe": dict(model_type="olmoe", num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                  intermediate_size=128, norm_topk_prob=False),
}


def save_with_transformers(arch: str, out_dir: str, seed: int = 0) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from moonep_ep.tools.checkpoints.tiny_model import write_wordlevel_tokenizer

    kwargs = dict(COMMON, **ARCHITECTURES[arch])
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # transformers initializes tiny weights; random normal ones give varied outputs
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 if "embed" in name else 0.05)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    with tempfile.TemporaryDirectory() as words:
        write_wordlevel_tokenizer(words, COMMON["vocab_size"], COMMON["max_position_embeddings"])
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(words, "tokenizer.json"), bos_token="<s>",
                                            eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                            model_max_length=COMMON["max_position_embeddings"])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ARCHITECTURES:
        print(f"usage: python -m tests.support.hf_checkpoint {{{'|'.join(ARCHITECTURES)}}} OUT_DIR",
              file=sys.stderr)
        return 2
    out = save_with_transformers(args[0], args[1])
    print(json.dumps({"path": out, "files": sorted(os.listdir(out))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
