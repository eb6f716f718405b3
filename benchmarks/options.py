"""The beyond-the-paper options against default ghost, same model, tokens and depth.

    python benchmarks/options.py [--model smollm2-135m] [--samples 16] [--remove 7]

Rows: streamline + ghost (relative ridge 1e-6, the default) vs ghost-aware selection (contiguous, and
the non-contiguous ghost-aware-runs); ridge 1e-6 vs auto; for shortgpt (several runs) dense vs
sequential fitting; the layer-by-layer ``offload`` calibration (must equal the first row). Perplexity
on held-out text, and zero-shot accuracy through lm-eval on the offline tasks (``--tasks ''`` skips it).
"""

from __future__ import annotations

import argparse
import copy

import ghostlayers
from ghostlayers.corpora import load_text
from ghostlayers.data import batched, calibration_windows, tokenize
from ghostlayers.evaluation import evaluate, perplexity_windows
from ghostlayers.loading import load_for_offload, load_model_and_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--remove", type=int, default=7)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ppl", default="wiki,news")
    parser.add_argument("--ppl-windows", type=int, default=8)
    parser.add_argument("--tasks", default="gl_social_iqa,gl_winogrande,gl_cause_and_effect")
    parser.add_argument("--limit", type=int, default=200, help="zero-shot examples per task")
    args = parser.parse_args()
    dense, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    train = tokenize(tokenizer, load_text("wiki", "train"))
    batches = batched(calibration_windows(train, args.samples, args.seq_len, 0), 4)
    windows = perplexity_windows(tokenizer, args.ppl.split(","), args.seq_len, args.ppl_windows)
    tasks = [t for t in args.tasks.split(",") if t]

    def measure(model) -> dict[str, float]:
        metrics = evaluate(model, tokenizer, windows, tasks, args.limit, speed=False)
        out = {f"ppl {k}": v for k, v in metrics["ppl"].items()}
        out |= {t: 100 * v.get("acc_norm", v["acc"]) for t, v in metrics.get("zeroshot", {}).items()}
        if tasks:
            out["0-shot avg"] = sum(out[t] for t in tasks) / len(tasks)
        return out

    rows = [("dense", "–", measure(dense))]
    for name, kwargs in [
        ("streamline, relative ridge 1e-6 (default)", dict(select="streamline")),
        ("streamline, offload (layer by layer)", dict(select="streamline", offload=True)),
        ("ghost-aware selection", dict(select="ghost-aware")),
        ("ghost-aware-runs selection", dict(select="ghost-aware-runs")),
        ("streamline, ridge auto", dict(select="streamline", ridge="auto")),
        ("shortgpt, dense fit (one operator per run)", dict(select="shortgpt")),
        ("shortgpt, sequential fit", dict(select="shortgpt", fit="sequential")),
        ("shortgpt, none", dict(select="shortgpt", method="none")),
    ]:
        if kwargs.pop("offload", False):
            checkpoint, _ = load_for_offload(args.model, device="cpu")
            model, kwargs["offload"] = checkpoint.skeleton(), checkpoint
        else:
            model = copy.deepcopy(dense)
        result = ghostlayers.prune(model, batches, num_layers=args.remove, progress=False, **kwargs)
        ridges = ", ".join(f"{b.ridge:.0e}" for b in result.boundaries)
        rows.append((name, f"{result.removed} (λ {ridges})", measure(result.model)))
        print(rows[-1], flush=True)
    columns = list(rows[0][2])
    print(f"\n{args.model}, remove {args.remove}, {args.samples} × {args.seq_len} calibration tokens\n")
    print("| variant | removed | " + " | ".join(columns) + " |\n" + "|---" * (len(columns) + 2) + "|")
    for name, removed, values in rows:
        print(f"| {name} | {removed} | " + " | ".join(f"{values[c]:.2f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
