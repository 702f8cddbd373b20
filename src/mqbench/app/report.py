"""A run's report: ``report.md`` and a self-contained ``report.html`` with its plots embedded.

Plots (matplotlib, PNG, embedded as data URIs so the HTML file travels alone): accuracy of the
float model, the simulation and the deployed model on its runtime; the quantization error of each
quantized tensor (SQNR against the float value of the same tensor: weights against the float
weight, activations against the float model's activation at that point); from verification, how
many tensors of each artifact differ from the simulation by 0, 1, 2 ... LSB; for QAT, the loss and
accuracy per epoch. Tables carry the same figures and the host's facts.

Example:
    >>> import torch
    >>> round(sqnr_db(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5])), 2)   # 25 / 0.25 -> 20 dB
    20.0
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections import Counter
from typing import Any

import torch
from torch import Tensor, nn

from mqbench.fake_quantize.quantize_base import QuantizeBase
from mqbench.utils.role import role_of
from mqbench.utils.state import disable_all, enable_quantization

__all__ = [
    "format_percent",
    "format_perplexity",
    "layer_errors",
    "lsb_histogram",
    "render_html",
    "render_markdown",
    "sqnr_db",
]


def sqnr_db(reference: Tensor, quantized: Tensor) -> float:
    """Signal to quantization-noise ratio in dB: ``10 log10(sum(ref^2) / sum((q - ref)^2))`` (inf when exact)."""
    noise = float((quantized.double() - reference.double()).square().sum())
    signal = float(reference.double().square().sum())
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(max(signal, 1e-300) / noise)


@torch.no_grad()
def layer_errors(qmodel: nn.Module, inputs: Tensor) -> list[dict[str, Any]]:
    """SQNR (dB) of every quantizer's output on ``inputs``, in graph order.

    Weights: the quantized weight against the float weight the quantizer received. Activations: the
    quantized model's tensor against the float model's tensor at the same point (the same graph with
    every quantizer off), so an activation's figure includes what earlier layers lost.
    """
    quantizers = [(name, m) for name, m in qmodel.named_modules() if isinstance(m, QuantizeBase)]
    captured: dict[str, list[Tensor]] = {}

    def hook(name: str) -> Any:
        def record(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if isinstance(output, Tensor):
                captured.setdefault(name, []).append(output.detach().float().clone())

        return record

    was_training = qmodel.training
    qmodel.eval()
    switches = {name: (bool(m.observer_enabled[0]), bool(m.fake_quant_enabled[0])) for name, m in quantizers}
    handles = [m.register_forward_hook(hook(name)) for name, m in quantizers]
    try:
        disable_all(qmodel)
        qmodel(inputs)
        reference = {name: values[0] for name, values in captured.items()}
        captured.clear()
        enable_quantization(qmodel)
        qmodel(inputs)
        quantized = {name: values[0] for name, values in captured.items()}
    finally:
        for handle in handles:
            handle.remove()
        for name, module in quantizers:
            observer, fake_quant = switches[name]
            module.enable_observer(observer)
            module.enable_fake_quant(fake_quant)
        qmodel.train(was_training)
    rows = []
    for name, module in _graph_order(qmodel, quantizers):
        if name in reference and name in quantized and reference[name].shape == quantized[name].shape:
            role = role_of(name, module)
            rows.append(
                {
                    "tensor": role.layer if role.kind == "weight" else name,
                    "kind": role.kind,
                    "bits": module.bitwidth,
                    "sqnr_db": sqnr_db(reference[name], quantized[name]),
                }
            )
    return rows


def _graph_order(model: nn.Module, quantizers: list[tuple[str, QuantizeBase]]) -> list[tuple[str, QuantizeBase]]:
    """Quantizers in the order the graph runs them (a layer's weight quantizer at the layer)."""
    graph = getattr(model, "graph", None)
    if graph is None:
        return quantizers
    by_name = dict(quantizers)
    weights = {role.layer: name for name, q in quantizers if (role := role_of(name, q)).kind == "weight"}
    ordered: list[tuple[str, QuantizeBase]] = []
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        for name in (weights.get(str(node.target), ""), str(node.target)):
            if name in by_name and all(name != seen for seen, _ in ordered):
                ordered.append((name, by_name[name]))
    ordered += [(name, q) for name, q in quantizers if all(name != seen for seen, _ in ordered)]
    return ordered


def _png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _plots(results: dict[str, Any]) -> dict[str, str]:
    """Base64 PNGs by name; empty when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    plots: dict[str, str] = {}
    acc = results["accuracy"]
    bars = [
        (label, acc[key]) for label, key in (("float", "float"), ("simulated", "simulated"), ("deployed", "deployed"))
    ]
    bars = [(label, value) for label, value in bars if value is not None]
    if bars:
        figure, axis = plt.subplots(figsize=(5, 3))
        axis.bar([b[0] for b in bars], [100 * b[1] for b in bars], color=["#888888", "#3b75af", "#519e3e"][: len(bars)])
        for index, (_, value) in enumerate(bars):
            axis.text(index, 100 * value, f"{100 * value:.2f}", ha="center", va="bottom")
        axis.set_ylabel("top-1 accuracy (%)")
        axis.set_ylim(0, 105)
        plots["accuracy"] = _png(figure)
    errors = results.get("layer_errors") or []
    if errors:
        figure, axis = plt.subplots(figsize=(max(6, 0.18 * len(errors)), 3.5))
        values = [min(e["sqnr_db"], 80.0) for e in errors]
        colors = ["#3b75af" if e["kind"] == "weight" else "#ef8636" for e in errors]
        axis.bar(range(len(errors)), values, color=colors)
        axis.set_xticks(range(len(errors)))
        axis.set_xticklabels([e["tensor"] for e in errors], rotation=90, fontsize=6)
        axis.set_ylabel("SQNR (dB, capped at 80)")
        axis.set_title("quantization error per tensor (blue: weights, orange: activations)")
        plots["layer_errors"] = _png(figure)
    artifacts = results["verify"].get("lsb_histograms") or {}
    if artifacts:
        figure, axis = plt.subplots(figsize=(5, 3))
        width = 0.8 / len(artifacts)
        for index, (key, counts) in enumerate(artifacts.items()):
            lsbs = sorted(int(k) for k in counts)
            axis.bar([x + index * width for x in lsbs], [counts[str(x)] for x in lsbs], width=width, label=key)
        axis.set_xlabel("max LSB difference of a tensor from the simulation")
        axis.set_ylabel("tensors")
        axis.legend(fontsize=7)
        plots["lsb"] = _png(figure)
    history = results.get("training", {}).get("history") or []
    if history:
        figure, loss_axis = plt.subplots(figsize=(5, 3))
        epochs = [h["epoch"] for h in history]
        loss_axis.plot(epochs, [h["loss"] for h in history], "o-", color="#3b75af", label="loss")
        loss_axis.set_xlabel("epoch")
        loss_axis.set_ylabel("mean training loss")
        if any(h["accuracy"] is not None for h in history):
            accuracy_axis = loss_axis.twinx()
            accuracy_axis.plot(epochs, [100 * (h["accuracy"] or 0) for h in history], "s--", color="#519e3e")
            accuracy_axis.set_ylabel("simulated accuracy (%)")
        plots["training"] = _png(figure)
    profile = results.get("profile") or []
    layers = list(dict.fromkeys(row["name"] for row in profile))
    if layers:
        figure, axis = plt.subplots(figsize=(max(6, 0.22 * len(layers)), 3.5))
        for (mode, part), style in (
            (("standalone", "weight"), "o"),
            (("standalone", "activation"), "^"),
            (("interaction", "both"), "s-"),
        ):
            sqnr = {r["name"]: min(r["sqnr_db"], 80.0) for r in profile if (r["mode"], r["part"]) == (mode, part)}
            if sqnr:
                xs = [i for i, name in enumerate(layers) if name in sqnr]
                axis.plot(xs, [sqnr[layers[i]] for i in xs], style, markersize=4, label=f"{mode} {part}")
        axis.set_xticks(range(len(layers)))
        axis.set_xticklabels(layers, rotation=90, fontsize=6)
        axis.set_ylabel("SQNR of the layer output (dB, capped at 80)")
        axis.legend(fontsize=7)
        plots["profile"] = _png(figure)
    points = [p for p in (results.get("mixed_precision") or {}).get("pareto", []) if p.get("accuracy") is not None]
    if points:
        figure, axis = plt.subplots(figsize=(5, 3))
        points = sorted(points, key=lambda p: p["size_bytes"])
        axis.plot([p["size_bytes"] / 1e6 for p in points], [100 * p["accuracy"] for p in points], "s-")
        axis.set_xlabel("quantized weights (MB)")
        axis.set_ylabel("top-1 accuracy (%)")
        axis.set_title("mixed precision: accuracy against size")
        plots["pareto"] = _png(figure)
    return plots


def _profile_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The profile as one row per layer, a column per (mode, part) measured, SQNR in dB."""
    profile = results.get("profile") or []
    order = [("standalone", "weight"), ("standalone", "activation"), ("standalone", "both"), ("interaction", "both")]
    present = {(r["mode"], r["part"]) for r in profile}
    columns = [column for column in order if column in present]
    layers = list(dict.fromkeys((r["name"], r["op"]) for r in profile))
    values = {(r["name"], r["mode"], r["part"]): r["sqnr_db"] for r in profile}
    header = ["layer", "op", *[f"{mode} {part} SQNR (dB)" for mode, part in columns]]
    rows = [
        [name, op, *[_db(values[(name, m, p)]) if (name, m, p) in values else "" for m, p in columns]]
        for name, op in layers
    ]
    return header, rows


def _mixed_rows(results: dict[str, Any]) -> tuple[str, list[list[str]], list[list[str]]]:
    mixed = results.get("mixed_precision") or {}
    summary = (
        f"{mixed['size_bytes'] / 1e6:.3f} MB of quantized weights, {mixed['bitops']:.3g} BitOps (budget "
        + ", ".join(f"{k} {v:.4g}" for k, v in mixed["budget"].items())
        + f"; candidates W{mixed['candidates']['weight']} A{mixed['candidates']['activation']})"
    )
    layers = [
        [name, str(weight), "float" if activation is None else str(activation)]
        for name, (weight, activation) in mixed["bits"].items()
    ]
    pareto = [
        [
            ", ".join(f"{k} {v:.4g}" for k, v in p["budget"].items()),
            "no" if not p["feasible"] else f"{p['size_bytes'] / 1e6:.3f}",
            "" if not p["feasible"] else f"{p['bitops']:.3g}",
            format_percent(p.get("accuracy")),
        ]
        for p in mixed.get("pareto", [])
    ]
    return summary, layers, pareto


def lsb_histogram(report: Any) -> dict[str, dict[str, int]]:
    """Per artifact: how many quantized tensors differ from the simulation by each max LSB difference."""
    histograms = {}
    for key, art in report.artifacts.items():
        counts = Counter(str(round(d.max_lsb_diff)) for d in art.per_tensor.values() if d.max_lsb_diff is not None)
        if counts:
            histograms[key] = dict(sorted(counts.items(), key=lambda item: int(item[0])))
    return histograms


def format_percent(value: float | None) -> str:
    """A fraction as a percentage with two decimals; "-" for none."""
    return "-" if value is None else f"{100 * value:.2f} %"


def format_perplexity(value: float | None) -> str:
    """A perplexity with four decimals; "-" for none."""
    return "-" if value is None else f"{value:.4f}"


def float_layers_text(results: dict[str, Any]) -> str:
    """The layers the backend left float by their role, as a sentence ("" for none)."""
    layers = results.get("float_layers") or {}
    if not layers:
        return ""
    named = ", ".join(f"{name} ({role})" for name, role in layers.items())
    return f"Left float by the backend (float_layers): {named}."


def _method(results: dict[str, Any]) -> str:
    """The run's method, with its weight-rounding algorithm where it has one."""
    algorithm = results.get("algorithm")
    return f"{results['method']} ({algorithm})" if algorithm else str(results["method"])


def _cosine(value: float) -> str:
    return f"{value:.4f}"


def _metric_rows(results: dict[str, Any], short: bool = False) -> tuple[list[str], list[list[str]]]:
    """The metric's columns and a row per model: the float, simulated and deployed models' held-out perplexity
    (a language model; lower is better) or top-1 accuracy; a sentence encoder's simulated and deployed embeddings'
    agreement with the float model's (mean and min cosine, nearest-neighbour agreement; higher is better)."""
    if "embedding" in results:
        figures = results["embedding"]
        artifact = figures.get("deployed_artifact") or "-"
        columns = [
            "mean cosine to float embeddings (higher is better)",
            "min cosine",
            "nearest-neighbour agreement",
        ]
        labels = {
            "simulated": "simulated" if short else "simulated (fake quantization)",
            "deployed": f"deployed ({artifact})" if short else f"deployed ({artifact}, on its runtime)",
        }
        return columns, [
            [
                label,
                _cosine(figures[key]["mean_cosine"]),
                _cosine(figures[key]["min_cosine"]),
                format_percent(figures[key]["neighbour_agreement"]),
            ]
            for key, label in labels.items()
        ]
    if "perplexity" in results:
        figures, shown, header = results["perplexity"], format_perplexity, "held-out perplexity (lower is better)"
    else:
        figures, shown, header = results["accuracy"], format_percent, "top-1 accuracy"
    artifact = figures.get("deployed_artifact") or "-"
    return [header], [
        ["float", shown(figures["float"])],
        ["simulated" if short else "simulated (fake quantization)", shown(figures["simulated"])],
        [f"deployed ({artifact})" if short else f"deployed ({artifact}, on its runtime)", shown(figures["deployed"])],
    ]


def _db(value: float) -> str:
    return "exact" if math.isinf(value) else f"{value:.1f}"


def render_markdown(results: dict[str, Any]) -> str:
    """``report.md``: the report's tables."""
    columns, figures = _metric_rows(results)
    lines = [
        f"# {results['command']} run: {results['model']} on {results['backend']}",
        "",
        f"Data: {results['data']['source']} ({results['data']['calibration_samples']} calibration samples, "
        f"{results['data']['val_samples']} validation samples). Method: {_method(results)}.",
        *([float_layers_text(results)] if results.get("float_layers") else []),
        "",
        "| model | " + " | ".join(columns) + " |",
        "|" + " --- |" * (len(columns) + 1),
        *["| " + " | ".join(row) + " |" for row in figures],
        "",
    ]
    history = results.get("training", {}).get("history")
    if history:
        lines += ["## Training", "", "| epoch | mean loss | simulated accuracy |", "| --- | --- | --- |"]
        lines += [f"| {h['epoch']} | {h['loss']:.4f} | {format_percent(h['accuracy'])} |" for h in history]
        lines.append("")
    errors = results.get("layer_errors") or []
    if errors:
        lines += [
            "## Quantization error per tensor",
            "",
            "| tensor | kind | bits | SQNR (dB) |",
            "| --- | --- | --- | --- |",
        ]
        lines += [f"| {e['tensor']} | {e['kind']} | {e['bits']} | {_db(e['sqnr_db'])} |" for e in errors]
        lines.append("")
    if results.get("profile"):
        header, rows = _profile_rows(results)
        lines += ["## Per-layer profile (SQNR of each layer's output against float)", ""]
        lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
    if results.get("mixed_precision"):
        summary, layers, pareto = _mixed_rows(results)
        lines += ["## Mixed precision", "", summary, "", "| layer | weight bits | input bits |", "| --- | --- | --- |"]
        lines += ["| " + " | ".join(row) + " |" for row in layers]
        if pareto:
            lines += ["", "| budget | size MB | BitOps | accuracy |", "| --- | --- | --- | --- |"]
            lines += ["| " + " | ".join(row) + " |" for row in pareto]
        lines.append("")
    verify = results["verify"]
    lines += [
        f"## Verification ({verify['samples']} samples, tolerance {verify['tolerance']} LSB)",
        "",
        "| artifact | runtime | max LSB difference | exact |",
        "| --- | --- | --- | --- |",
    ]
    for key, art in verify["artifacts"].items():
        lines.append(f"| {key} | {art['runtime']} | {art['max_lsb_diff']:.3g} | {100 * art['exact_fraction']:.1f} % |")
    lines += ["", f"Verdict: {'passed' if verify['passed'] else 'FAILED'}.", ""]
    if verify["failures"]:
        lines += [*[f"- {line}" for line in verify["failures"]], ""]
    fidelity = results.get("simulation_vs_float")
    if fidelity:
        shown = ", ".join(
            f"{o['name']} {'exact' if o['sqnr_db'] is None else _db(o['sqnr_db']) + ' dB'} (cosine {o['cosine']:.4f})"
            for o in fidelity["outputs"]
        )
        lines += [f"The simulation against the float model on these samples: {shown}.", ""]
        if fidelity["warning"]:
            lines += [f"**Warning**: {fidelity['warning']}", ""]
    lines += [
        results["host"],
        "",
        "Timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in results["seconds"].items()),
        "",
    ]
    return "\n".join(lines)


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(results: dict[str, Any]) -> str:
    """``report.html``: one file, plots embedded."""
    plots = _plots(results)
    columns, figures = _metric_rows(results, short=True)
    heading = {"embedding": "Sentence embeddings", "perplexity": "Perplexity"}
    shown = next((title for key, title in heading.items() if key in results), "Accuracy")

    def image(name: str, alt: str) -> str:
        if name not in plots:
            return ""
        return f'<img id="plot-{name}" alt="{html.escape(alt)}" src="data:image/png;base64,{plots[name]}">'

    parts = [
        f"<h1>{html.escape(results['command'])} run: {html.escape(results['model'])} on "
        f"{html.escape(results['backend'])}</h1>",
        f"<p>Data: {html.escape(results['data']['source'])}; method: {html.escape(_method(results))}.</p>",
        *([f"<p>{html.escape(float_layers_text(results))}</p>"] if results.get("float_layers") else []),
        f"<h2>{shown}</h2>",
        _table(["model", *columns], figures),
        image("accuracy", "accuracy of the float, simulated and deployed models"),
    ]
    history = results.get("training", {}).get("history") or []
    if history:
        rows = [[str(h["epoch"]), f"{h['loss']:.4f}", format_percent(h["accuracy"])] for h in history]
        parts += ["<h2>Training</h2>", _table(["epoch", "mean loss", "simulated accuracy"], rows)]
        parts.append(image("training", "training loss and accuracy per epoch"))
    errors = results.get("layer_errors") or []
    if errors:
        rows = [[e["tensor"], e["kind"], str(e["bits"]), _db(e["sqnr_db"])] for e in errors]
        parts += ["<h2>Quantization error per tensor</h2>", image("layer_errors", "SQNR of every quantized tensor")]
        parts.append(_table(["tensor", "kind", "bits", "SQNR (dB)"], rows))
    if results.get("profile"):
        header, rows = _profile_rows(results)
        parts += ["<h2>Per-layer profile</h2>", image("profile", "SQNR of each layer's output against float")]
        parts.append(_table(header, rows))
    if results.get("mixed_precision"):
        summary, layers, pareto = _mixed_rows(results)
        parts += ["<h2>Mixed precision</h2>", f"<p>{html.escape(summary)}</p>"]
        parts.append(_table(["layer", "weight bits", "input bits"], layers))
        if pareto:
            parts.append(_table(["budget", "size MB", "BitOps", "accuracy"], pareto))
            parts.append(image("pareto", "accuracy against the size of the quantized weights"))
    verify = results["verify"]
    rows = [
        [key, art["runtime"], f"{art['max_lsb_diff']:.3g}", f"{100 * art['exact_fraction']:.1f} %"]
        for key, art in verify["artifacts"].items()
    ]
    parts += [
        f"<h2>Verification ({verify['samples']} samples, tolerance {verify['tolerance']} LSB): "
        f"{'passed' if verify['passed'] else 'FAILED'}</h2>",
        _table(["artifact", "runtime", "max LSB difference", "exact"], rows),
        image("lsb", "tensors by their max LSB difference from the simulation"),
    ]
    if verify["failures"]:
        parts.append("<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in verify["failures"]) + "</ul>")
    facts = results.get("host_facts") or {}
    fact_rows = [[str(k), str(v)] for k, v in facts.items() if k != "runtimes"]
    fact_rows += [[f"runtime {k}", str(v)] for k, v in (facts.get("runtimes") or {}).items()]
    parts += ["<h2>Host</h2>", f"<p>{html.escape(results['host'])}</p>", _table(["fact", "value"], fact_rows)]
    parts.append("<p>Timings (s): " + html.escape(", ".join(f"{k} {v:.1f}" for k, v in results["seconds"].items())))
    style = (
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}"
        "img{max-width:100%;display:block;margin:0.5em 0}"
    )
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>mqbench {html.escape(results["command"])} '
        f"report</title><style>{style}</style></head><body>{''.join(parts)}</body></html>\n"
    )
