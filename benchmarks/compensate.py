"""Do the kept layers' own MLP output weights absorb what the removed block leaves? (issue #14, 3c)

    python benchmarks/compensate.py [--model smollm2-135m] [--layers 13:19] [--after 0,1,2,4]

Ghost corrects the stream at one point and the kept layers after it then see inputs they were not trained
on, so the error grows again. Here, in the manner of layer-wise reconstruction (SparseGPT, Frantar &
Alistarh 2023, which refits a layer's weights so its output on the compressed model's inputs matches the
dense output), each of the ``k`` kept layers after the boundary in turn gets its ``down_proj`` refitted in
closed form: with ``a`` its MLP's hidden activations and ``h`` its post-attention stream on the pruned,
repaired model, ``D = argmin ‖a D − (Y − h)‖²`` (ridge normal equations), ``Y`` the dense stream after that
layer. The next layer is then fitted on the refitted one's output. No parameters are added: ``k·I·C``
existing weights change and the checkpoint keeps its architecture. Rows with no ghost refit the last kept
layer before the block as well, its target the dense stream entering the first kept layer after it; one
row then fits ghost on the stream that refitted layer hands over. Llama-like MLPs only (the down
projection adds straight onto the stream); perplexity on the held-out parts of wiki, web, code and austen with
the share of the none→dense gap. Writes ``benchmarks/results/compensate-<model>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
from cells import ResultsFile, model_arguments, ppl_share_cells, ppl_share_header, shares
from neurons import ridge_solve

from ghostlayers.adapters import decoder_layers, layer_output, layer_subset
from ghostlayers.data import calibration_set, tokenize
from ghostlayers.evaluation import perplexity_windows
from ghostlayers.loading import load_model_and_tokenizer
from ghostlayers.perplexity import perplexity
from ghostlayers.selection import parse_layers
from ghostlayers.sources.corpora import OFFLINE, calibration_sources, load_text


class _Stop(Exception):
    """Raised by a hook once the layer of interest has run: the layers after it are not needed."""


@torch.no_grad()
def layer_inputs(model, batch: torch.Tensor, layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, h)`` at ``layer`` for one batch, flattened to tokens: its MLP's down-projection input and the
    stream its MLP adds onto (the layer's output less that MLP's output), running only the layers up to it."""
    seen: dict[str, torch.Tensor] = {}

    def grab_a(module, args):
        seen["a"] = args[0].detach()

    def grab_out(module, args, out):
        seen["out"] = layer_output(out).detach()
        raise _Stop

    handles = [
        layer.mlp.down_proj.register_forward_pre_hook(grab_a),
        layer.register_forward_hook(grab_out),
    ]
    try:
        with contextlib.suppress(_Stop):
            model(input_ids=batch, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    h = seen["out"] - layer.mlp.down_proj(seen["a"])
    return seen["a"].reshape(-1, seen["a"].shape[-1]).float(), h.reshape(-1, h.shape[-1]).float()


def refit_down_proj(
    a: torch.Tensor, h: torch.Tensor, target: torch.Tensor, ridge: float, start: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """The least-squares ``down_proj`` weight (``C × I``) with ``a Wᵀ ≈ target − h``, ridge relative to the
    Gram matrix's mean diagonal, and the fit's relative residual. The ridge pulls ``W`` toward ``start``
    (the trained weight) when given, else toward zero."""
    a64, rhs = a.double(), (target - h).double()
    base = torch.zeros(a.shape[1], rhs.shape[1], dtype=torch.float64) if start is None else start.double().T
    w = base + ridge_solve(a64, rhs - a64 @ base, ridge)
    residual = ((a64 @ w - rhs).norm() / rhs.norm()).item()
    return w.T.float(), residual


def table(results: dict) -> str:
    """The markdown table of docs/RESULTS.md, from the JSON alone."""
    cells, settings = results["cells"], results["settings"]
    if "none" not in cells or "dense" not in cells:  # a run's first cells: no shares yet
        return ""
    none, dense = cells["none"]["ppl"], cells["dense"]["ppl"]
    lines = [
        f"{results['model']}, removed {settings['removed']}, {settings['tokens']} calibration tokens from "
        f"{settings['calibration']}, {settings['dtype']}; refit ridge {settings['refit_ridge']:g} (relative)\n",
        f"| fit | added parameters | changed parameters | {ppl_share_header(list(OFFLINE))} |",
        "|---" * (3 + 2 * len(OFFLINE)) + "|",
    ]
    for name, r in cells.items():
        gap = (none, dense) if name not in ("none", "dense") else (None, None)
        added = f"{r['added parameters']:,}" if "added parameters" in r else "–"
        changed = f"{r['changed parameters']:,}" if "changed parameters" in r else "–"
        lines.append(f"| {name} | {added} | {changed} | {ppl_share_cells(r['ppl'], list(OFFLINE), *gap)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser, dtype=True)
    parser.add_argument("--layers", default="13:19")
    parser.add_argument("--after", default="0,1,2,4", help="numbers of kept layers after the boundary to refit")
    parser.add_argument("--calibration", default="mix")
    parser.add_argument("--per-channel", type=float, default=32, help="calibration tokens per hidden channel")
    parser.add_argument("--ridge", type=float, default=1e-6, help="ghost's, relative to the mean diagonal")
    parser.add_argument("--refit-ridge", type=float, default=1e-2, help="the refits', relative likewise")
    parser.add_argument("--shrink-to", choices=("zero", "trained"), default="zero", help="the refits' ridge target")
    parser.add_argument("--json")
    args = parser.parse_args()
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, device="cpu")
    model.requires_grad_(False)
    size, total = model.config.hidden_size, model.config.num_hidden_layers
    removed = parse_layers(args.layers, total)
    pre, post = removed[0], removed[-1] + 1
    keep = [i for i in range(total) if i not in removed]
    layers = decoder_layers(model)
    texts = {c: tokenize(tokenizer, load_text(c, "train")) for c in calibration_sources(args.calibration)}
    batches = calibration_set(texts, round(args.per_channel * size / args.seq_len), args.seq_len).batches(4)
    test = perplexity_windows(tokenizer, list(OFFLINE), args.seq_len, args.ppl_windows)
    depths = sorted(int(k) for k in args.after.split(","))
    if post + depths[-1] >= total:
        parser.error(f"--after {depths[-1]} refits past the model's last layer but one")
    inter = layers[post].mlp.down_proj.in_features
    originals = {i: layers[i].mlp.down_proj.weight.detach().clone() for i in keep}
    cache: dict[str, object] = {}

    def calibration() -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """The dense stream entering every layer a fit needs (flattened calibration tokens) and ghost's
        ``M``, computed at the first cell that needs them."""
        if not cache:
            needed = [pre, post, *range(post + 1, post + depths[-1] + 1)]
            kept: dict[int, list[torch.Tensor]] = {i: [] for i in needed}
            with torch.no_grad():
                for b in batches:
                    hidden = model(input_ids=b, use_cache=False, output_hidden_states=True).hidden_states
                    for i in needed:
                        kept[i].append(hidden[i].reshape(-1, size).float())
            cache["states"] = {i: torch.cat(s) for i, s in kept.items()}
            cache["m"] = ghost_fit(cache["states"][pre], cache["states"][post])
        return cache["states"], cache["m"]

    def ghost_fit(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Ghost's ``M`` from boundary states ``x`` to ``y`` (ridge ``--ridge``)."""
        return ridge_solve(x.double(), (y - x).double(), args.ridge).float()

    def attach(m: torch.Tensor):
        """``x ↦ x + x M`` on the stream entering the first kept layer after the block; returns the hook."""

        def patch(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            hidden = hidden + (hidden.float() @ m).to(hidden.dtype)
            return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

        return layers[post].register_forward_pre_hook(patch, with_kwargs=True)

    @contextlib.contextmanager
    def pruned(m: torch.Tensor | None):
        """The pruned model, with ghost's ``M`` at the boundary unless None."""
        with layer_subset(model, keep):
            handle = attach(m) if m is not None else None
            try:
                yield
            finally:
                if handle is not None:
                    handle.remove()

    def ppl() -> dict[str, float]:
        return {c: perplexity(model, w, 4, progress=False) for c, w in test.items()}

    def variant(ghost: str, refit: list[int]) -> dict:
        """Refit ``refit``'s down projections in order on the pruned model, score it, then restore them.
        ``ghost``: "dense" (ghost fitted on the dense states, as published), "refitted" (fitted on the
        stream the refitted last kept layer hands over) or "" (none)."""
        fits, states = {}, calibration()[0] if refit else {}  # the dense model's, before any layer is set aside
        handle = None
        try:
            with pruned(calibration()[1] if ghost == "dense" else None):
                for i in refit:
                    target = states[post] if i == pre - 1 else states[i + 1]
                    pairs = [layer_inputs(model, b, layers[i]) for b in batches]
                    a, h = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
                    before = ((a @ originals[i].float().T + h - target).norm() / (target - h).norm()).item()
                    start = originals[i] if args.shrink_to == "trained" else None
                    w, after = refit_down_proj(a, h, target, args.refit_ridge, start)
                    layers[i].mlp.down_proj.weight.copy_(w.to(originals[i].dtype))
                    fits[i] = {"residual before": before, "residual after": after}
                    print(f"  layer {i}: relative residual {before:.3f} → {after:.3f}", flush=True)
                    if i == pre - 1 and ghost == "refitted":
                        handle = attach(ghost_fit(h + a @ w.T, target))
                return {"ppl": ppl(), "refit": fits}
        finally:
            if handle is not None:
                handle.remove()
            for i in refit:
                layers[i].mlp.down_proj.weight.copy_(originals[i])

    toward = ", ridge toward trained" if args.shrink_to == "trained" else ""
    variants = {"ghost": ("dense", [])}
    variants |= {f"ghost, refit {k} after{toward}": ("dense", list(range(post, post + k))) for k in depths if k}
    variants |= {
        f"no ghost, refit 1 before + {k} after{toward}": ("", [pre - 1, *range(post, post + k)]) for k in depths
    }
    variants[f"refit 1 before, then ghost on its output{toward}"] = ("refitted", [pre - 1])
    results = ResultsFile(
        Path(args.json or f"benchmarks/results/compensate-{args.model}.json"), args.model, args.dtype, render=table
    )
    results.data["settings"] = {**vars(args), "removed": removed, "tokens": sum(b.numel() for b in batches)}
    with torch.no_grad():
        dense = results.cell("dense", lambda: {"ppl": ppl()})["ppl"]

        def plain() -> dict:
            with pruned(None):
                return {"ppl": ppl()}

        none = results.cell("none", plain)["ppl"]
        for name, (ghost, refit) in variants.items():
            cell = results.cell(
                name,
                lambda ghost=ghost, refit=refit: {
                    **variant(ghost, refit),
                    "added parameters": size * size if ghost else 0,
                    "changed parameters": len(refit) * inter * size,
                },
            )
            cell["share"] = shares(cell["ppl"], none, dense)
    results.save()
    print(table(results.data))


if __name__ == "__main__":
    main()
