"""What one healing step costs from the teacher cache, against a naive student + teacher loop, per trained token.

    python benchmarks/heal.py [--model smollm2-135m] [--layers 20:26] [--batch-size 2] [--seq-len 512]

The pruned model is ``--layers`` removed and repaired by ghost (on random tokens: time does not depend on the
text). In rounds (``--repeats``), each round running every step once in turn, the median and range of:
- one forward pass of the pruned model over the batch (the unit of issue #41's cost target);
- a cached step: one batch read from the teacher cache, the layers from the boundary on and the head forward,
  the loss and its backward (``heal.cached_loss``), as ``heal.train`` runs it;
- a naive step: the dense teacher's forward and the whole student's forward and backward (``heal.naive_loss``);
first training the operator, then LoRA adapters on the layers from the boundary on. Writes
``benchmarks/results/heal-cost-<model>.md``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from harness import machine, model_arguments
from sweep_cost import interleaved

import ghostlayers
from ghostlayers import heal
from ghostlayers.adapters import starting_at
from ghostlayers.loading import load_model_and_tokenizer


def steps(student, dense, cache: heal.TeacherCache, batch: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The three timed steps on one batch (cache entry 0 holds it). The cached step enters ``starting_at`` each
    time (training enters it once; the swap of the layer list is microseconds next to the step)."""

    def forward() -> None:
        with torch.no_grad():
            student(input_ids=batch, use_cache=False)

    def cached() -> None:
        with starting_at(student, cache.depth) as slot:
            heal.cached_loss(student, slot, cache.load(0)).backward()

    def naive() -> None:
        heal.naive_loss(student, dense, batch, cache.topk).backward()

    return {"pruned forward": forward, "cached step": cached, "naive step": naive}


def rows(times: dict[str, list[float]], params: str, tokens: int) -> list[str]:
    """Table rows: median and range, seconds per 100k trained tokens, and the share of a pruned forward."""
    unit = statistics.median(times["pruned forward"])
    out = []
    for name, values in times.items():
        median = statistics.median(values)
        out.append(
            f"| {name} | {params if name != 'pruned forward' else '–'} | {median:.3f} | {min(values):.3f}–"
            f"{max(values):.3f} | {median * 1e5 / tokens:.1f} | {median / unit:.2f} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser, ppl_windows=None, dtype=True)
    parser.add_argument("--layers", default="20:26", help="the removed block (as prune --layers)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dense, _ = load_model_and_tokenizer(args.model, args.dtype, "cpu")
    student, _ = load_model_and_tokenizer(args.model, args.dtype, "cpu")
    g, shape = torch.Generator().manual_seed(0), (args.batch_size, args.seq_len)
    batches = [torch.randint(0, dense.config.vocab_size, shape, generator=g) for _ in range(2)]
    ghostlayers.prune(student, batches, layers=args.layers, method="ghost", alpha=1.0, progress=False)
    tokens = batches[0].numel()
    lines = [
        f"# Healing cost per step: {args.model}, {args.layers} removed, {args.batch_size} × {args.seq_len} tokens",
        "",
        f"{machine(args.dtype)}; median of {args.repeats} interleaved rounds (`python benchmarks/heal.py "
        f"--model {args.model} --layers {args.layers} --batch-size {args.batch_size} --seq-len {args.seq_len}`).",
        "",
        "| step | trains | median s | range s | s per 100k tokens | × pruned forward |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as folder:
        cache = heal.cache_teacher(dense, batches[:1], heal.heal_depth(student), 50, Path(folder), progress=False)
        for params in (["operator"], ["lora"]):
            heal.make_trainable(student, params, cache.depth)
            lines += rows(interleaved(steps(student, dense, cache, batches[0]), args.repeats), params[0], tokens)
            print("\n".join(lines), flush=True)
    out = Path(__file__).parent / "results" / f"heal-cost-{Path(args.model).name}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
