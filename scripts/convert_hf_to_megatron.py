"""Converts a HF checkpoint into a megascore Megatron distributed checkpoint.

Run it under torchrun with as many ranks as the layout you convert with (any
layout works: the result loads into every TP / CP / EP layout)::

    torchrun --nproc-per-node 2 scripts/convert_hf_to_megatron.py \\
        --hf /models/Llama-3.1-8B --out /ckpt/llama31-8b --tp 2 --dtype bfloat16

Each rank reads only its own shards of the safetensors files. The output
directory is then served with ``megascore serve --model megatron:/ckpt/...``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megascore.checkpoint import resolve_model
from megascore.checkpoint.megatron_ckpt import save_checkpoint
from megascore.config import EngineConfig
from megascore.model.build import build_model
from megascore.model.parallel import destroy_parallel, initialize_parallel, resolve_device

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf", required=True, help="HF checkpoint directory")
    parser.add_argument("--out", required=True, help="output directory (created, must be empty)")
    parser.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size")
    parser.add_argument("--ep", type=int, default=1, help="expert_model_parallel_size")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--weights-version", default="", help="label stored with the weights")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    engine_cfg = EngineConfig(
        model=f"hf:{args.hf}",
        tensor_model_parallel_size=args.tp,
        expert_model_parallel_size=args.ep,
        dtype=args.dtype,
        device=args.device,
    )
    if engine_cfg.device != "cpu" and torch.cuda.is_available():
        # One GPU per rank: without this every rank of a node would use cuda:0 and NCCL
        # would refuse the group ("Duplicate GPU detected").
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = resolve_device(engine_cfg)
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    try:
        pgs = initialize_parallel(engine_cfg)
        model_cfg, load_weights, _ = resolve_model(engine_cfg.model)
        model = build_model(model_cfg, engine_cfg, pgs)
        load_weights(model)
        save_checkpoint(model, model_cfg, args.out, weights_version=args.weights_version or None)
        if dist.get_rank() == 0:
            copied = [f for f in TOKENIZER_FILES if (Path(args.hf) / f).is_file()]
            for name in copied:  # the served model then reports has_tokenizer
                shutil.copy2(Path(args.hf) / name, Path(args.out) / name)
            logger.info(
                "converted %s (%s) -> %s, tokenizer files %s",
                args.hf,
                model_cfg.architecture,
                args.out,
                copied,
            )
        destroy_parallel()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
