"""What refit-ghost's one extra sum costs, against the second truncated pass it spares.

    python benchmarks/refit_ghost_sums.py [--model qwen2.5-coder-1.5b --dtype bfloat16] [--block 12:19]

refit-ghost fits ghost on the stream ``X' = X + A E`` that refit hands over. Its sums ``X'ᵀX'`` and
``X'ᵀY`` follow from refit's own (``AᵀA``, ``Aᵀ(Y − X)``) plus one more product, ``AᵀX`` (I × C), taken in
the same calibration pass (``stats.PairStats.refitted``). The alternative is a second pass after refit:
run the calibration batches again through the layers up to the block's end. Per calibration batch, on the
same machine in one run, this prints (and writes to ``benchmarks/results/refit-ghost-sums-<model>.md``) the
time of refit's ``AᵀA``, of the extra ``AᵀX``, and of that second pass's forward (without the products it
would also need).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from harness import median_seconds, model_arguments

from ghostlayers.model.adapters import layer_subset
from ghostlayers.numerics.products import product
from ghostlayers.store.loading import load_model_and_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser, ppl_windows=None, dtype=True)
    parser.add_argument("--block", default="12:19", help="the removed block, first:end")
    parser.add_argument("--batch", type=int, default=4, help="sequences per calibration batch")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, _ = load_model_and_tokenizer(args.model, dtype=args.dtype)
    config = model.config
    end = int(args.block.split(":")[1])
    tokens = args.batch * args.seq_len
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len), generator=generator)
    # the states' values do not change a product's time: their shapes and dtype do
    x = torch.randn(tokens, config.hidden_size, generator=generator).to(model.dtype)
    a = torch.randn(tokens, config.intermediate_size, generator=generator).to(model.dtype)

    def second_pass() -> None:
        with torch.inference_mode(), layer_subset(model, list(range(end))):
            model.base_model(input_ids=ids)

    cpu = torch.device("cpu")
    rows = {
        "refit's AᵀA (I × I)": median_seconds(cpu, lambda: product(a, a, torch.float64), args.repeats),
        "refit-ghost's extra AᵀX (I × C)": median_seconds(cpu, lambda: product(a, x, torch.float64), args.repeats),
        f"second pass: forward through layers 0..{end - 1}": median_seconds(cpu, second_pass, args.repeats),
    }
    extra = rows["refit-ghost's extra AᵀX (I × C)"]
    lines = [
        f"{args.model} ({args.dtype}), C = {config.hidden_size}, I = {config.intermediate_size}, "
        f"{args.batch} × {args.seq_len} tokens per batch, {torch.get_num_threads()} CPU threads\n",
        "| per calibration batch | seconds | × the extra AᵀX |",
        "|---|---|---|",
        *(f"| {name} | {seconds:.2f} | {seconds / extra:.1f} |" for name, seconds in rows.items()),
    ]
    text = "\n".join(lines) + "\n"
    Path(f"benchmarks/results/refit-ghost-sums-{args.model}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
