"""A second repair at the end of the pruned model (moonshot of issue 31, a probe): after each of ``--bases``
(ghost, none), one more C×C operator ``W = I + M`` on the state entering the final norm, fitted by the same ridge
least squares on the pruned model's own final states against dense's, ``(HᵀH + λI) M = Hᵀ(H_dense − H)``.
A boundary repair restores the stream where the block was cut; the layers after it then still act on a
stream that is not dense's, and this operator sees what reaches the output.

    python benchmarks/tail.py --model qwen2.5-coder-1.5b --dtype bfloat16 --block streamline:7 --limit 100 \\
        --reference benchmarks/results/quality-qwen2.5-coder-1.5b.json \\
        --json benchmarks/results/tail-qwen2.5-coder-1.5b.json

The calibration and plan are ``quality.py``'s (same windows, the cached plan), so the reference file's dense,
none and ghost cells are copied in and the rows are paired with them; tables as ``quality.py`` renders them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from harness import ResultsFile, block_plan, model_arguments, open_bench, quality_tables

import ghostlayers
from ghostlayers.model.adapters import adapter_for
from ghostlayers.registry.methods import DEFAULT_RIDGE
from ghostlayers.repair.guard import shared_depth
from ghostlayers.sources.corpora import calibration_sources


def final_state(model, batch: torch.Tensor, at: str) -> torch.Tensor:
    """The state entering (``at="input"``) or leaving (``"output"``: the LM head's input) the final norm
    (float64, tokens × C)."""
    out: list[torch.Tensor] = []
    norm = model.get_submodule(adapter_for(model).final_norm)
    if at == "input":
        handle = norm.register_forward_pre_hook(lambda _m, args: out.append(args[0].detach().double().flatten(0, 1)))
    else:
        handle = norm.register_forward_hook(lambda _m, _args, y: out.append(y.detach().double().flatten(0, 1)))
    try:
        with torch.no_grad():
            model(batch, use_cache=False)
    finally:
        handle.remove()
    return out[0]


def fit_tail(pruned, dense_states: list[torch.Tensor], batches, ridge: float, at: str) -> torch.Tensor:
    """``W = I + M`` from the pruned model's final states and dense's (``dense_states``, one per batch), relative
    ridge ``λ = ridge · tr(HᵀH) / C``."""
    size = pruned.config.hidden_size
    gram = torch.zeros(size, size, dtype=torch.float64)
    cross = torch.zeros(size, size, dtype=torch.float64)
    for batch, d in zip(batches, dense_states, strict=True):
        h = final_state(pruned, batch, at)
        gram += h.T @ h
        cross += h.T @ (d - h)
    eye = torch.eye(size, dtype=torch.float64)
    return eye + torch.linalg.solve(gram + ridge * gram.trace() / size * eye, cross)


@contextlib.contextmanager
def tail_added(model, w: torch.Tensor, at: str) -> Iterator[None]:
    """``W`` on the state entering or leaving the final norm, for the block inside (a hook: a probe, not a saved
    model)."""
    weight = w.float()
    norm = model.get_submodule(adapter_for(model).final_norm)
    if at == "input":
        handle = norm.register_forward_pre_hook(lambda _m, args: ((args[0].float() @ weight).to(args[0].dtype),))
    else:
        handle = norm.register_forward_hook(lambda _m, _args, y: (y.float() @ weight).to(y.dtype))
    try:
        yield
    finally:
        handle.remove()


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser, dtype=True)
    parser.add_argument("--block", default="streamline:6")
    parser.add_argument("--bases", default="ghost,none", help="repairs the tail operator is added to")
    parser.add_argument("--calibration", default="mix")
    parser.add_argument("--per-channel", type=float, default=32)
    parser.add_argument("--ridge", type=float, default=DEFAULT_RIDGE, help="the tail operator's relative ridge")
    parser.add_argument("--at", choices=("input", "output"), default="input", help="of the final norm")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--reference", required=True, help="quality.py's JSON for the same model and calibration")
    parser.add_argument("--json", required=True)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    store = ResultsFile(Path(args.json), args.model, args.dtype, render=quality_tables)
    reference = json.loads(Path(args.reference).read_text())
    sources = calibration_sources(args.calibration)
    bench = open_bench(args, sources)
    dense = bench.dense
    total = dense.config.num_hidden_layers
    block = args.block.replace(":", " ") + f"/{total}"
    for key in (
        "dense ppl",
        "dense zeroshot",
        *(f"{block} {m} {k}" for m in ("none", "ghost") for k in ("ppl", "zeroshot")),
    ):
        if key in reference["cells"]:
            store.data["cells"].setdefault(key, reference["cells"][key])
    store.data.update({k: reference[k] for k in ("label", "description")}, blocks=[block])
    num_samples = bench.windows(args.per_channel, len(sources))
    data = bench.calibration(sources, num_samples)
    plan = block_plan(args, bench, data, block)
    depth = shared_depth(plan.pairs)
    suffix = "" if args.ridge == DEFAULT_RIDGE else f" ridge {args.ridge:g}"

    operators: dict[str, torch.Tensor] = {}  # per base: fitted once, for its perplexity and zero-shot cells

    @contextlib.contextmanager
    def tailed(base: str) -> Iterator[ghostlayers.PruneResult]:
        """The base pruned in place (``ghostlayers.applied``), the tail on it; dense again after."""
        targets = [final_state(dense, b, args.at) for b in data.batches(4)] if base not in operators else None
        with ghostlayers.applied(dense, plan, ghostlayers.FitSettings(base, progress=False)) as result:
            if targets is not None:  # dense's states, taken above while the model was dense
                operators[base] = fit_tail(dense, targets, data.batches(4), args.ridge, args.at)
            with tail_added(dense, operators[base], args.at):
                yield result

    for base in args.bases.split(","):
        label = f"{base}+{'tail' if args.at == 'input' else 'head'}{suffix}"

        def ppl(base=base) -> dict:
            with tailed(base) as result:
                return {"ppl": bench.perplexity(dense, depth), "removed": result.removed, "fit residual": float("nan")}

        def zeroshot(base=base) -> dict:
            tasks = list(reference["cells"]["dense zeroshot"]["zeroshot"])
            with tailed(base):
                return {"zeroshot": bench.zeroshot(dense, tasks, args.limit, args.batch_size, depth)}

        store.cell(f"{block} {label} ppl", ppl)
        if args.limit:
            store.cell(f"{block} {label} zeroshot", zeroshot)
    store.save()
    print(quality_tables(store.data))


if __name__ == "__main__":
    main()
