"""What one healing step costs from the teacher cache, against a naive student + teacher loop, per trained token.

    python benchmarks/heal.py [--model smollm2-135m] [--layers 13:19] [--batch-size 2] [--seq-len 512]

The pruned model is ``--layers`` removed and repaired by ghost (on random tokens: time does not depend on the
text). In rounds (``--repeats``), each round running every step once in turn, the median and range of:
- one forward pass of the pruned model over the batch, without adapters (the unit of issue #41's cost target);
- a cached step: one batch read from the teacher cache, the layers from the boundary on and the head's rows
  of the teacher's top-k tokens, the loss and its backward (``heal.cached_loss``), as ``heal.train`` runs it;
- the same step with the whole head (every vocabulary logit, then the top k), as healing ran before;
- a naive step: the dense teacher's forward and the whole student's forward and backward (``heal.naive_loss``);
first training the operator, then LoRA adapters on the layers from the boundary on. Writes
``benchmarks/results/heal-cost-<model>.md``.

    python benchmarks/heal.py --quality [--block "streamline 6/30"] [--methods ghost,none] [--tokens 0,8192]

The quality against healing tokens: each method fitted on the default calibration (``mix``, 32 tokens per
channel, 2 held-out windows a source, ``--alpha auto``), healed on it for each token count (``auto`` params:
the operator where the method has one, else LoRA) with the guard, and scored on each offline corpus's test
windows: perplexity and the KL to the dense model's top-50 distribution. Cells are kept in
``benchmarks/results/heal-quality-<model>.json`` (and ``.md``) as each finishes: the same command resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from harness import ResultsFile, block_plan, machine, model_arguments, open_bench
from sweep_cost import interleaved

import ghostlayers
from ghostlayers.config.recipes import HealSettings, split
from ghostlayers.model.adapters import starting_at
from ghostlayers.model.surgery import DenseLayers
from ghostlayers.repair import heal
from ghostlayers.repair.guard import shared_depth
from ghostlayers.sources.corpora import MIX_CORPORA
from ghostlayers.store.loading import load_model_and_tokenizer


def steps(student, plain, dense, cache: heal.TeacherCache, batch: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The three timed steps on one batch (cache entry 0 holds it). The unit is the forward of ``plain``, the
    pruned model without adapters (LoRA's layers would slow the unit and flatter LoRA). The cached step enters
    ``starting_at`` each time (training enters it once; the swap of the layer list is microseconds)."""

    def forward() -> None:
        with torch.no_grad():
            plain(input_ids=batch, use_cache=False)

    def cached() -> None:
        with starting_at(student, cache.depth) as slot:
            heal.cached_loss(heal.Student(student), slot, cache.load(0)).backward()

    def full_head() -> None:  # the cached step as it was: the whole vocabulary's logits, then the top k
        entry = cache.load(0)
        with starting_at(student, cache.depth) as slot:
            slot[:] = [entry.state]
            logits = student(input_ids=entry.ids, use_cache=False).logits
            heal.topk_kl(logits, entry.values, entry.indices).backward()

    def naive() -> None:
        heal.naive_loss(student, dense, batch, cache.topk).backward()

    return {"pruned forward": forward, "cached step": cached, "cached step, full head": full_head, "naive step": naive}


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


def cost(args: argparse.Namespace) -> None:
    """The cost table (see the module's first command)."""
    dense, _ = load_model_and_tokenizer(args.model, args.dtype, "cpu")
    student, _ = load_model_and_tokenizer(args.model, args.dtype, "cpu")
    g, shape = torch.Generator().manual_seed(0), (args.batch_size, args.seq_len)
    batches = [torch.randint(0, dense.config.vocab_size, shape, generator=g) for _ in range(2)]
    ghostlayers.prune(student, batches, layers=args.layers, method="ghost", alpha=1.0, progress=False)
    plain, tokens = copy.deepcopy(student), batches[0].numel()
    lines = [
        f"# Healing cost per step: {args.model}, {args.layers} removed, {args.batch_size} × {args.seq_len} tokens",
        "",
        f"{machine(args.dtype)}; median of {args.repeats} interleaved rounds (`python benchmarks/heal.py "
        f"--model {args.model} --dtype {args.dtype} --layers {args.layers} --batch-size {args.batch_size} "
        f"--seq-len {args.seq_len} --repeats {args.repeats}`); other jobs shared the CPU.",
        "",
        "| step | trains | median s | range s | s per 100k tokens | × pruned forward |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as folder:
        cache = heal.cache_teacher(dense, batches[:1], heal.heal_depth(student), 50, Path(folder), progress=False)
        for params in (["operator"], ["lora"]):
            heal.make_trainable(student, params, cache.depth)
            timed = interleaved(steps(student, plain, dense, cache, batches[0]), args.repeats)
            lines += rows(timed, params[0], tokens)
            print("\n".join(lines), flush=True)
    out = Path(__file__).parent / "results" / f"heal-cost-{Path(args.model).name}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def quality_table(results: dict) -> str:
    """The quality cells as one markdown table, in the order they ran."""
    corpora = list(next(iter(results["cells"].values()))["ppl"])
    columns = " | ".join(f"{c} ppl | {c} KL" for c in corpora)
    lines = [f"# Held-out quality against healing tokens: {results['model']}", ""]
    lines += [f"| method | tokens | trains | kept | train KL | {columns} |", "|---" * (5 + 2 * len(corpora)) + "|"]
    for key, cell in results["cells"].items():
        method, tokens = key.rsplit(" ", 1)
        cells = " | ".join(f"{cell['ppl'][c]:.2f} | {cell['kl'][c]:.4f}" for c in corpora)
        lines.append(f"| {method} | {tokens} | {cell['trains']} | {cell['kept']} | {cell['train_kl']:.4f} | {cells} |")
    return "\n".join(lines)


def quality(args: argparse.Namespace) -> None:
    """The quality table (see the module's second command)."""
    args.calibration = "mix"
    bench = open_bench(args, list(MIX_CORPORA))
    data = bench.calibration(list(MIX_CORPORA), bench.windows(32, len(MIX_CORPORA)), heldout=2)
    plan = block_plan(args, bench, data, args.block)
    out = Path(__file__).parent / "results" / f"heal-quality-{Path(args.model).name}.json"
    results = ResultsFile(out, args.model, args.dtype, quality_table)
    with tempfile.TemporaryDirectory() as folder:
        caches: dict[tuple[str, int], heal.TeacherCache] = {}
        Teacher = Callable[[], contextlib.AbstractContextManager[torch.nn.Module]]

        def teacher(name: str, windows: list[torch.Tensor], depth: int, dense: Teacher) -> heal.TeacherCache:
            if (name, depth) not in caches:
                where = Path(folder) / f"{name}-{depth}"
                where.mkdir()
                with dense() as model:
                    caches[name, depth] = heal.cache_teacher(model, windows, depth, 50, where, progress=False)
            return caches[name, depth]

        def cell(method: str, tokens: int) -> dict:
            layers, settings = DenseLayers.of(bench.dense), ghostlayers.FitSettings(method, progress=False)
            with ghostlayers.applied(bench.dense, plan, settings, data.heldout) as result:  # dense again after
                model, depth = result.model, heal.heal_depth(result.model)
                dense = functools.partial(heal.dense_teacher, model, layers, result.unfolded)  # no second copy
                done = None
                if tokens:  # prune's own healing path; the teacher's cache of the training windows kept for every cell
                    healing = HealSettings(tokens, "auto", args.lr, 50)
                    done = result.heal = heal.heal_pruned(model, data.batches(4), healing, Path(folder) / "heal",
                                                          dense, {"model": args.model}, keep_cache=True,
                                                          heldout=data.heldout, unfolded=result.unfolded,
                                                          progress=False)  # fmt: skip
                train = teacher("train", data.batches(4), depth, dense)
                tests = {c: teacher(c, list(w.split(4)), depth, dense) for c, w in bench.test.items()}
                kl = {c: heal.cache_loss(model, cache) for c, cache in tests.items()}
                return {
                    "ppl": bench.perplexity(model, shared_depth(plan.pairs)),
                    "kl": kl,
                    "train_kl": done.loss_after if done else heal.cache_loss(model, train),
                    "trains": ",".join(done.params) if done else "–",
                    "kept": done.kept if done else "–",
                    "alpha": result.alpha,
                    "heal": done.to_dict() if done else None,
                }

        for method in split(args.methods):
            for tokens in (int(t) for t in split(args.tokens)):
                results.cell(f"{method} {tokens}", lambda m=method, t=tokens: cell(m, t))
    print(quality_table(results.data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser, ppl_windows=4, dtype=True)
    parser.add_argument(
        "--layers",
        default="13:19",
        help="cost: the removed block (as prune --layers; the "
        "default is the quality run's streamline 6/30 block on SmolLM2)",
    )
    parser.add_argument("--batch-size", type=int, default=2, help="cost: windows per step")
    parser.add_argument("--repeats", type=int, default=5, help="cost: interleaved rounds")
    parser.add_argument("--quality", action="store_true", help="the quality table instead of the cost table")
    parser.add_argument("--block", default="streamline 6/30", help="quality: the criterion and depth")
    parser.add_argument("--methods", default="ghost,none", help="quality: comma-separated methods")
    parser.add_argument("--tokens", default="0,8192", help="quality: comma-separated healing token counts")
    parser.add_argument("--lr", type=float, default=1e-3, help="quality: --heal-lr")
    args = parser.parse_args()
    (quality if args.quality else cost)(args)


if __name__ == "__main__":
    main()
