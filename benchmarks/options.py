"""The beyond-the-paper options against paper-faithful ghost, same model, tokens and depth.

    python benchmarks/options.py [--model smollm2-135m] [--samples 16] [--remove 7]

Rows: streamline + ghost (paper) vs ghost-aware selection; ridge 1e-6 vs auto; for shortgpt (several
runs) dense vs sequential fitting. Perplexity on held-out wiki text.
"""

from __future__ import annotations

import argparse
import copy

import ghostlayers
from ghostlayers.corpora import load_text
from ghostlayers.data import batched, calibration_windows, tokenize
from ghostlayers.evaluation import perplexity_windows
from ghostlayers.loading import load_model_and_tokenizer
from ghostlayers.perplexity import perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--remove", type=int, default=7)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ppl-windows", type=int, default=8)
    args = parser.parse_args()
    dense, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    train = tokenize(tokenizer, load_text("wiki", "train"))
    batches = batched(calibration_windows(train, args.samples, args.seq_len, 0), 4)
    test = perplexity_windows(tokenizer, ["wiki"], args.seq_len, args.ppl_windows)["wiki"]
    rows = [("dense", "–", perplexity(dense, test, progress=False))]
    for name, kwargs in [
        ("streamline, ridge 1e-6 (paper)", dict(select="streamline")),
        ("ghost-aware selection", dict(select="ghost-aware")),
        ("streamline, ridge auto", dict(select="streamline", ridge="auto")),
        ("shortgpt, dense fit (paper)", dict(select="shortgpt")),
        ("shortgpt, sequential fit", dict(select="shortgpt", fit="sequential")),
        ("shortgpt, none", dict(select="shortgpt", method="none")),
    ]:
        result = ghostlayers.prune(copy.deepcopy(dense), batches, num_layers=args.remove, progress=False, **kwargs)
        rows.append((name, str(result.removed), perplexity(result.model, test, progress=False)))
        print(rows[-1], flush=True)
    print(f"\n{args.model}, remove {args.remove}, {args.samples} × {args.seq_len} calibration tokens\n")
    print("| variant | removed | ppl wiki |\n|---|---|---|")
    for name, removed, ppl in rows:
        print(f"| {name} | {removed} | {ppl:.2f} |")


if __name__ == "__main__":
    main()
