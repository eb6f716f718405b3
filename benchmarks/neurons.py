"""Does keeping a few of the removed MLPs' own neurons as regression features beat ghost? (issue #14, 3a)

    python benchmarks/neurons.py [--model smollm2-135m] [--layers 13:19] [--calibration mix]

Ghost maps the boundary state linearly: ``Y − X ≈ X M``. What a removed block adds is mostly its MLPs'
output, a nonlinear function of the stream. Here each removed layer's MLP is applied to ``X`` directly (its
own pre-MLP norm, gate and up projections; the attention is skipped), the ``k`` neurons with the most output
energy (``E[a²]·‖down column‖²``, over all removed layers) are kept, and ``Y − X ≈ X M + φ(X) N`` is
fitted jointly in closed form (ridge normal equations over ``[X, φ]``). Added parameters: ``C²`` for
``M``, and ``3kC`` for ``k`` neurons (gate row, up row, output row; the norms' ``C`` each are not counted).
Compared at equal parameters (``C²``: ghost, or ``k = C/3`` neurons alone) and above (ghost + ``k``
neurons). Llama-like MLPs only (gate, up, down, SiLU); perplexity on the held-out parts of wiki, web, code and
austen with the share of the none→dense gap. Writes ``benchmarks/results/neurons-<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from cells import machine, model_arguments, ppl_share_cells, ppl_share_header, shares

from ghostlayers.adapters import decoder_layers, layer_subset
from ghostlayers.calibration import boundary_state
from ghostlayers.data import calibration_set, tokenize
from ghostlayers.evaluation import perplexity_windows
from ghostlayers.loading import load_model_and_tokenizer
from ghostlayers.perplexity import perplexity
from ghostlayers.selection import parse_layers
from ghostlayers.sources.corpora import OFFLINE, calibration_sources, load_text


class Neurons:
    """Chosen neurons of the removed layers' MLPs, evaluated on the boundary state."""

    def __init__(self, model, removed: list[int], chosen: list[tuple[int, int]]):
        layers = decoder_layers(model)
        self.parts = []
        for layer in sorted({lay for lay, _ in chosen}):
            rows = torch.tensor([n for lay, n in chosen if lay == layer])
            mlp = layers[layer].mlp
            self.parts.append(
                (
                    layers[layer].post_attention_layernorm,
                    mlp.gate_proj.weight[rows].detach().clone(),
                    mlp.up_proj.weight[rows].detach().clone(),
                    mlp.down_proj.weight[:, rows].detach().clone(),
                )
            )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.part(norm(x), g, u) for norm, g, u, _ in self.parts], dim=-1)

    @staticmethod
    def part(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(h @ gate.T) * (h @ up.T)

    def down(self) -> torch.Tensor:
        """The neurons' original output rows, ``k × C``."""
        return torch.cat([d.T for *_, d in self.parts])


@torch.no_grad()
def energies(model, removed: list[int], x: torch.Tensor) -> list[tuple[float, int, int]]:
    """``(E[a²]·‖down column‖², layer, neuron)`` of every neuron of the removed layers, MLP applied to ``x``."""
    layers = decoder_layers(model)
    out = []
    for layer in removed:
        mlp, norm = layers[layer].mlp, layers[layer].post_attention_layernorm
        power = torch.zeros(mlp.gate_proj.out_features, dtype=torch.float64)
        for chunk in x.split(4096):
            h = norm(chunk.float())
            power += (F.silu(mlp.gate_proj(h)) * mlp.up_proj(h)).double().pow(2).sum(0)
        score = power / x.shape[0] * mlp.down_proj.weight.double().pow(2).sum(0)
        out += [(float(s), layer, n) for n, s in enumerate(score)]
    return sorted(out, reverse=True)


def ridge_solve(features: torch.Tensor, target: torch.Tensor, ridge: float) -> torch.Tensor:
    gram = features.T @ features
    lam = ridge * gram.diagonal().mean()
    return torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), features.T @ target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--layers", default="13:19")
    parser.add_argument("--calibration", default="mix")
    parser.add_argument("--per-channel", type=float, default=32, help="calibration tokens per hidden channel")
    parser.add_argument("--ridge", type=float, default=1e-6, help="relative to the Gram matrix's mean diagonal")
    parser.add_argument("--json")
    args = parser.parse_args()
    start = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    model.requires_grad_(False)
    size, total = model.config.hidden_size, model.config.num_hidden_layers
    removed = parse_layers(args.layers, total)
    pre, post = removed[0], removed[-1] + 1
    texts = {c: tokenize(tokenizer, load_text(c, "train")) for c in calibration_sources(args.calibration)}
    batches = calibration_set(texts, round(args.per_channel * size / args.seq_len), args.seq_len).batches(4)
    test = perplexity_windows(tokenizer, list(OFFLINE), args.seq_len, args.ppl_windows)
    with torch.no_grad():
        x = torch.cat([boundary_state(model, b, pre).reshape(-1, size) for b in batches])
        y = torch.cat([boundary_state(model, b, post).reshape(-1, size) for b in batches])
    ranked = energies(model, removed, x)
    x64, delta = x.double(), (y - x).double()
    keep = [i for i in range(total) if i not in removed]

    def ppl(correction=None) -> dict[str, float]:
        """Perplexity of the dense model (None) or of the pruned one with ``x ↦ x + correction(x)`` at the
        boundary."""
        if correction is None:
            return {c: perplexity(model, w, 4, progress=False) for c, w in test.items()}

        def patch(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            hidden = hidden + correction(hidden.float()).to(hidden.dtype)
            return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

        with layer_subset(model, keep):
            handle = decoder_layers(model)[pre].register_forward_pre_hook(patch, with_kwargs=True)
            try:
                return {c: perplexity(model, w, 4, progress=False) for c, w in test.items()}
            finally:
                handle.remove()

    def variant(k: int, linear: bool, refit: bool):
        """The correction and its added parameters: ghost's ``X M`` (``linear``) and/or ``k`` neurons whose
        output rows are fitted jointly (``refit``) or kept as the model had them."""
        chosen = Neurons(model, removed, [(lay, n) for _, lay, n in ranked[:k]]) if k else None
        parts = ([x64] if linear else []) + ([chosen(x).double()] if chosen else [])
        target = delta if refit or chosen is None else delta - chosen(x).double() @ chosen.down().double()
        solution = ridge_solve(torch.cat(parts, dim=1), target, args.ridge) if linear or refit else None
        m = solution[:size].float() if linear else None
        n = (solution[size if linear else 0 :].float() if refit else chosen.down()) if chosen else None

        def correction(h: torch.Tensor) -> torch.Tensor:
            out = h @ m if m is not None else 0
            return out + chosen(h) @ n if chosen is not None else out

        fitted = torch.cat(parts, dim=1) @ solution if solution is not None else 0
        if not refit and chosen is not None:
            fitted = fitted + chosen(x).double() @ chosen.down().double()
        residual = ((delta - fitted).norm() / delta.norm()).item()
        return correction, (size * size if linear else 0) + 3 * k * size, residual

    third = size // 3
    variants = {
        "ghost (C²)": (0, True, True),
        f"{third} neurons, output rows refitted (C²)": (third, False, True),
        f"{third} neurons, output rows as trained (C²)": (third, False, False),
        f"ghost + {third} neurons, joint fit (2C²)": (third, True, True),
        f"ghost + {size} neurons, joint fit (4C²)": (size, True, True),
    }
    rows = {"dense": ppl(), "none": ppl(lambda h: torch.zeros_like(h))}
    for name, spec in variants.items():
        correction, params, residual = variant(*spec)
        rows[name] = {**ppl(correction), "added parameters": params, "fit residual": residual}
        rows[name]["share"] = shares({c: rows[name][c] for c in OFFLINE}, rows["none"], rows["dense"])
        print(name, rows[name], flush=True)
    result = {
        "model": args.model,
        "settings": {**vars(args), "removed": removed, "tokens": x.shape[0]},
        "machine": machine(),
        "rows": rows,
        "seconds": round(time.perf_counter() - start, 1),
    }
    path = Path(args.json or f"benchmarks/results/neurons-{args.model}.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{args.model}, removed {removed}, {x.shape[0]} calibration tokens from {args.calibration}\n")
    print(f"| fit | added parameters | {ppl_share_header(list(OFFLINE))} | fit residual |")
    print("|---" * (3 + 2 * len(OFFLINE)) + "|")
    for name, r in rows.items():
        gap = (rows["none"], rows["dense"]) if "share" in r else (None, None)
        params = f"{r['added parameters']:,}" if "added parameters" in r else "–"
        cells = ppl_share_cells(r, list(OFFLINE), *gap)
        print(f"| {name} | {params} | {cells} | {r.get('fit residual', float('nan')):.3f} |")


if __name__ == "__main__":
    main()
