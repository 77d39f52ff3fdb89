"""Independent reference: Hugging Face transformers' Qwen3 / Qwen3-MoE in float32 on the CPU.

Runs in its own Python 3.11 venv (CPU torch + transformers, made by `make test`); the tests call
it as a subprocess, so fp8rl_jax never imports torch. It builds a tiny random checkpoint with
transformers' own `save_pretrained` (single file or sharded) and computes logits by loading that
folder back with `from_pretrained`, so the reference sees exactly what is on disk.

  python hf_reference.py build  --config CFG.json --out DIR --seed S [--dtype float32|bfloat16] [--max-shard-size 64KB]
                                [--tokens IN.npy --logits-out OUT.npy]   (logits of the saved folder)
  python hf_reference.py logits --model DIR --tokens IN.npy --out OUT.npy
  python hf_reference.py greedy --model DIR --prompts IN.json --max-new-tokens N --out OUT.json
  python hf_reference.py batch JOBS.json   (a JSON list of argument lists of the commands above, run in
                                            order in this one process: torch and transformers load once)
"""

import argparse
import json

import numpy as np
import torch
import transformers


def build(args):
    cfg_dict = json.loads(open(args.config).read())
    cls_name = cfg_dict.pop("architectures")[0]
    if cls_name == "Qwen3MoeForCausalLM":
        config = transformers.Qwen3MoeConfig(**cfg_dict)
        model_cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.Qwen3Config(**cfg_dict)
        model_cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(args.seed)
    model = model_cls(config).to(torch.float32)
    # HF's init leaves norms at one and logits near uniform; random scales of order one make
    # every parameter, norms and router included, visible in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model = model.to(getattr(torch, args.dtype))
    kw = {"max_shard_size": args.max_shard_size} if args.max_shard_size else {}
    model.save_pretrained(args.out, **kw)
    if args.tokens:
        args.model, args.out = args.out, args.logits_out
        logits(args)


def logits(args):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    tokens = torch.from_numpy(np.load(args.tokens).astype(np.int64))
    with torch.no_grad():
        out = model(input_ids=tokens, use_cache=False).logits
    np.save(args.out, out.float().numpy())


def greedy(args):
    """transformers' own greedy generate, one prompt at a time (no padding), EOS ignored."""
    import json

    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    out = []
    with torch.no_grad():
        for prompt in json.load(open(args.prompts)):
            ids = torch.tensor([prompt], dtype=torch.int64)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                                 eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    json.dump(out, open(args.out, "w"))


def parser():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--config", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    b.add_argument("--max-shard-size", default=None)
    b.add_argument("--tokens", default=None)
    b.add_argument("--logits-out", default=None)
    lg = sub.add_parser("logits")
    lg.add_argument("--model", required=True)
    lg.add_argument("--tokens", required=True)
    lg.add_argument("--out", required=True)
    g = sub.add_parser("greedy")
    g.add_argument("--model", required=True)
    g.add_argument("--prompts", required=True)
    g.add_argument("--max-new-tokens", type=int, required=True)
    g.add_argument("--out", required=True)
    bt = sub.add_parser("batch")
    bt.add_argument("jobs")
    return ap


def run(args):
    {"build": build, "logits": logits, "greedy": greedy, "batch": batch}[args.cmd](args)


def batch(args):
    with open(args.jobs) as f:
        jobs = json.load(f)
    for argv in jobs:
        job = parser().parse_args(argv)
        if job.cmd == "batch":
            raise SystemExit("batch jobs cannot nest")
        run(job)


def main():
    args = parser().parse_args()
    torch.set_num_threads(2)
    run(args)


if __name__ == "__main__":
    main()
