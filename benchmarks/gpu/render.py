"""The GPU report's targets (issue item 3), its Markdown and its plots, from the JSON data."""

from __future__ import annotations

import math
from pathlib import Path

TARGETS = {
    "kernel": "fused TAPE fwd+bwd TFLOP/s >= 0.60 x RoPE SDPA-flash's, causal bf16, N 2k-16k, "
              "D 64 and 128",
    "e2e_ratio": "end-to-end training tokens/s TAPE / RoPE >= 0.90 at 350m, N = 2048",
    "rope_mfu": "RoPE MFU at 1b >= 40 % of the device's bf16 peak",
}


def attention_rows(data: dict) -> list:
    """The kernel-speed section's attention-core rows (not its state-update row)."""
    return [r for r in data["sections"].get("kernel_speed", {}).get("results", [])
            if "methods" in r]


def evaluate_targets(data: dict) -> dict:
    """Each target: met / missed / not measured, the measured value and its gap."""
    out = {}
    speed = attention_rows(data)
    ratios = []
    for row in speed:
        m = row["methods"]
        if 2048 <= row["N"] <= 16384 and row["D"] in (64, 128) and all(
                "fwd_bwd_tflops" in m.get(k, {}) for k in ("tape_fused", "rope_flash")):
            ratios.append((m["tape_fused"]["fwd_bwd_tflops"] / m["rope_flash"]["fwd_bwd_tflops"],
                           f"D={row['D']} H={row['heads']} N={row['N']}"))
    out["kernel"] = _verdict(ratios, 0.60, "fused/flash TFLOP/s")
    # End to end: each setting (eager; train.compile) compared like with like, the target
    # judged on the better one (the way a user would run).
    e2e = {(r["size"], r["pe"], bool(r.get("compile"))): r
           for r in data["sections"].get("end_to_end", {}).get("results", [])}
    ratios, mfus = [], []
    for compiled in (False, True):
        how = " compiled" if compiled else ""
        tape, rope = e2e.get(("350m", "tape", compiled), {}), e2e.get(("350m", "rope", compiled), {})
        if "tokens_per_s" in tape and "tokens_per_s" in rope:
            ratios.append((tape["tokens_per_s"] / rope["tokens_per_s"], "350m N=2048" + how))
        if "mfu" in e2e.get(("1b", "rope", compiled), {}):
            mfus.append((e2e[("1b", "rope", compiled)]["mfu"], "1b N=2048" + how))
    out["e2e_ratio"] = _verdict(ratios, 0.90, "TAPE/RoPE tokens/s", best=True)
    out["rope_mfu"] = _verdict(mfus, 0.40, "RoPE MFU", best=True)
    for key, text in TARGETS.items():
        out[key]["target"] = text
    return out


def _verdict(values: list[tuple[float, str]], threshold: float, what: str,
             best: bool = False) -> dict:
    """Met when the worst of ``values`` (``best``: the best, for alternative settings of one
    measurement) reaches ``threshold``; the judged value is reported as ``worst``."""
    if not values:
        return {"status": "not measured"}
    worst, where = max(values) if best else min(values)
    res = {"status": "met" if worst >= threshold else "missed", "what": what,
           "threshold": threshold, "worst": worst, "worst_at": where,
           "judged": "best" if best else "worst", "all": {w: v for v, w in values}}
    if worst < threshold:
        res["gap"] = threshold - worst
    return res


def target_lines(targets: dict) -> list[str]:
    lines = []
    for key, t in targets.items():
        if t["status"] == "not measured":
            lines.append(f"target {key}: NOT MEASURED ({t['target']})")
        else:
            gap = f", gap {t['gap']:.3f}" if "gap" in t else ""
            others = "".join(f"; {w}: {v:.3f}" for w, v in t["all"].items()
                             if w != t["worst_at"]) if t.get("judged") == "best" else ""
            lines.append(f"target {key}: {t['status'].upper()}: {t.get('judged', 'worst')} "
                         f"{t['what']} {t['worst']:.3f} at {t['worst_at']} vs "
                         f"{t['threshold']:.2f}{gap}{others}")
    return lines


def _f(x, fmt=".3g"):
    if x is None:
        return "–"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, fmt) if isinstance(x, (int, float)) else str(x)


def markdown(data: dict) -> str:
    m = data["machine"]
    head = "# GPU report" if data["complete"] else "# GPU report — PARTIAL (run did not finish)"
    lines = [head, "", f"`{data['command']}` on **{m.get('name')}** "
             f"(torch {m.get('torch')}, Triton {m.get('triton')}, DeepSpeed {m.get('deepspeed')}, "
             f"CUDA {m.get('cuda')}), {data['started']}; {data['elapsed_s']:.0f} s.", ""]
    if data.get("smoke"):
        lines += ["CPU smoke run: tiny shapes in Triton's interpreter; the numbers check the "
                  "code paths, not the speed of anything.", ""]
    if m.get("matmul_tflops"):
        lines += [f"Measured bf16 GEMM ceiling: {m['matmul_tflops']:.0f} TFLOP/s "
                  f"(datasheet dense peak {_f(m.get('bf16_peak_tflops'))}).", ""]
    lines += ["## Targets", ""] + [f"- {t}" for t in target_lines(data.get("targets", {}))] + [""]
    for name, sec in data["sections"].items():
        lines += [f"## {name.replace('_', ' ')} — {sec['status']}", ""]
        if sec.get("error"):
            lines += ["```", sec["error"][-2000:], "```", ""]
        lines += _SECTION_RENDER[name](sec["results"]) + [""]
    return "\n".join(lines)


def _correctness(results: list) -> list[str]:
    lines = []
    kernel = [r for r in results if "errors" in r or ("crash" in r and "D" in r)]
    for r in results:
        if "control" in r:
            c = r["control"]
            lines.append(f"- negative control: CRASHED: {c['crash']}" if "crash" in c else
                         f"- negative control ({c['what']}): error {_f(c['error'])} -> "
                         f"{'ok' if c['ok'] else 'FAILED'}")
        elif r.get("check") in ("model_backend", "kv_cache") and "crash" in r:
            lines.append(f"- {r['check']}: CRASHED: {r['crash']}")
        elif r.get("check") in ("model_backend", "kv_cache"):
            detail = {k: v for k, v in r.items() if k not in ("check", "ok")}
            lines.append(f"- {r['check']}: {'ok' if r['ok'] else 'FAILED'} {detail}")
        elif r.get("check") == "trainer":
            verdict = {True: "ok", False: "FAILED", None: "NOT JUDGED"}[r["ok"]]
            lines.append(f"- trainer (ZeRO-1/3, bf16 vs fp32, deterministic twice, "
                         f"{r['steps']} steps): "
                         f"{verdict}; max relative loss differences "
                         + ", ".join(f"{k} {_f(v)}" for k, v in r["comparisons"].items())
                         + (f"; failed: {list(r['failures'])}" if r["failures"] else "")
                         + (f"; skipped for time: {r['skipped_for_time']}"
                            if r["skipped_for_time"] else ""))
        elif r.get("check") == "host_syncs":
            verdict = {True: "ok", False: "FAILED", None: "NOT JUDGED (1 micro-batch)"}[r["ok"]]
            lines.append(f"- host syncs per step (none of tape_train's per micro-batch): "
                         f"{verdict}; " + "; ".join(
                             f"{name} {_f(run['per_step'])}/step of {run['micro_batches']} "
                             f"micro-batches, per micro-batch: {run['per_micro_batch'] or 'none'}"
                             for name, run in r["runs"].items()))
    if kernel:
        keys = next((list(r["errors"]) for r in kernel if "errors" in r), ["result"])
        lines += ["", "Fused kernel vs fp64 reference (relative error; tolerance in the JSON):", "",
                  "| dtype | D | N | dq | " + " | ".join(keys) + " | ok |",
                  "|---" * (len(keys) + 5) + "|"]
        for r in kernel:
            cells = ([_f(r["errors"][k], ".1e") for k in keys] if "errors" in r else
                     [f"crashed: {r['crash']}"] + [""] * (len(keys) - 1))
            lines.append(f"| {r['dtype']} | {r['D']} | {r['N']} | {r['dq']} | "
                         + " | ".join(cells) + f" | {'yes' if r['ok'] else 'NO'} |")
    return lines


def _speed(results: list) -> list[str]:
    names = ["tape_fused", "tape_unfused", "rope_flash", "rope_cudnn"]
    lines = ["fwd+bwd ms / TFLOP/s (FLOP model: RoPE 7U, TAPE 13U); last column fused/flash "
             "TFLOP/s.", "", "| D | heads | N | batch | " + " | ".join(names) + " | ratio |",
             "|---" * (len(names) + 5) + "|"]
    for r in results:
        if r.get("kind") == "state_update":
            continue
        m = r["methods"]
        cells = [f"{m[k]['fwd_bwd_ms']:.2f} / {m[k]['fwd_bwd_tflops']:.0f}" if "fwd_bwd_ms" in
                 m.get(k, {}) else ("error" if k in m else "–") for k in names]
        ratio = (m["tape_fused"]["fwd_bwd_tflops"] / m["rope_flash"]["fwd_bwd_tflops"]
                 if all("fwd_bwd_tflops" in m.get(k, {}) for k in ("tape_fused", "rope_flash"))
                 else None)
        lines.append(f"| {r['D']} | {r['heads']} | {r['N']} | {r['batch']} | " + " | ".join(cells)
                     + f" | {_f(ratio)} |")
    errors = {(k, v["error"]) for r in results for k, v in r.get("methods", {}).items()
              if "error" in v}
    lines += [f"- {k}: {e}" for k, e in sorted(errors)]
    for r in results:
        if r.get("kind") != "state_update":
            continue
        if "error" in r:
            lines.append(f"- TAPE state update: error: {r['error']}")
            continue
        v = r["variants"]
        lines.append(
            f"- TAPE state update (one block, both tables; M={r['M']} D={r['D']} P={r['P']} "
            f"N={r['N']} batch {r['batch']}, one table {r['e_mib']:.0f} MiB), fwd+bwd: "
            + "; ".join(f"{k} {x['ms']:.2f} ms (host {x['host_ms']:.2f} ms to issue), keeps "
                        f"{x['kept_mib']:.0f} MiB" for k, x in v.items())
            + f"; node/plain time {_f(v['node']['ms'] / v['plain']['ms'])}")
    return lines


def _sweep(results: list) -> list[str]:
    lines = ["| D | kernel | config | ms | TFLOP/s | error vs fp64 (tolerance) | ok |",
             "|---" * 7 + "|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['D']} | {r['kernel']} | {r['config']} | {r['error']} | | | no |")
        else:
            lines.append(f"| {r['D']} | {r['kernel']} | {r['config']} | {r['ms']:.3f} | "
                         f"{r['tflops']:.0f} | {r['err']:.1e} ({r['tolerance']:.1e}) | "
                         f"{'yes' if r['ok'] else 'NO'} |")
    return lines


def _e2e(results: list) -> list[str]:
    lines = ["| size | pe | micro-batch | tokens/s | MFU | peak mem (GiB) | peak reserved (GiB) "
             "| alloc retries | expandable segments | status |", "|---" * 10 + "|"]
    for r in results:
        expandable = {True: "on", False: "off"}.get(r.get("expandable_segments"), "–")
        lines.append(f"| {r['size']} | {_pe(r)} | {_f(r.get('micro_batch'))} | "
                     f"{_f(r.get('tokens_per_s'), '.0f')} | {_f(r.get('mfu'), '.1%')} | "
                     f"{_f(r.get('peak_mem_gib'), '.1f')} | {_f(r.get('reserved_gib'), '.1f')} | "
                     f"{_f(r.get('alloc_retries'), 'd')} | {expandable} | {r['status']} |")
    settings = list(dict.fromkeys(r["allocator"] for r in results if r.get("allocator")))
    if any("alloc_retries" in r for r in results):
        lines += ["", "CUDA caching allocator at that micro-batch: alloc retries = failed "
                  "cudaMalloc calls retried after freeing the cache (each a device-wide sync) "
                  "during the timed steps; expandable segments as the allocator reports its "
                  "segments."] + [f"- {line}" for line in settings]
    compiled = [r for r in results if "graph_breaks" in r]
    if compiled:
        lines += ["", "Graph breaks of the compiled rows (Dynamo's reasons and counts; the "
                  "attention core is kept eager on purpose; ZeRO-3's hooks break too where they sit "
                  "inside blocks, parallel.zero3_gather_blocks=false):"]
        lines += [f"- {r['size']} {_pe(r)}: " + ("; ".join(
            f"{reason} ×{n}" for reason, n in sorted(r["graph_breaks"].items(),
                                                    key=lambda kv: -kv[1])[:4]) or "none")
                  for r in compiled]
    return lines + _breakdown([r for r in results if r.get("profile")])


def _pe(row: dict) -> str:
    """The encoding of an end-to-end row, with ``+compile`` for a ``train.compile`` run."""
    return row["pe"] + (" +compile" if row.get("compile") else "")


def _breakdown(rows: list) -> list[str]:
    """Where one step's time goes, per row, at its micro-batch (one profiled step)."""
    if not rows:
        return []
    on_device = rows[0]["profile"]["device"] == "cuda"
    cats = list(dict.fromkeys(c for r in rows for c in r["profile"]["categories"]))
    lines = ["", "Where a step's time goes at that micro-batch (one step under torch.profiler; "
             + ("ms of device kernels per step, share of the step in brackets; idle = the "
                "device waited for the host" if on_device else
                "ms of the operators' own CPU time per step") + "):", "",
             "| | " + " | ".join(f"{r['size']} {_pe(r)}" for r in rows) + " |",
             "|---" * (len(rows) + 1) + "|"]

    def cell(r, ms):
        step = r["profile"]["step_ms"]
        return "–" if ms is None else f"{ms:.1f} ({ms / step:.0%})" if step else f"{ms:.1f}"

    for cat in cats:
        lines.append(f"| {cat} | " + " | ".join(cell(r, r["profile"]["categories"].get(cat, 0.0))
                                              for r in rows) + " |")
    if on_device:
        lines.append("| device idle | " + " | ".join(cell(r, r["profile"]["idle_ms"])
                                                   for r in rows) + " |")
    lines.append("| step (wall) | " + " | ".join(f"{r['profile']['step_ms']:.1f}"
                                               for r in rows) + " |")
    for r in rows:
        top = ", ".join(f"{k['name'][:60]} {k['ms']:.1f} ms" for k in r["profile"]["top"][:5])
        lines.append(f"- {r['size']} {_pe(r)}, largest: {top}")
        host = ", ".join(f"{t['name'][:60]} {t['ms']:.1f} ms"
                         for t in r["profile"].get("host_top", [])[:5])
        if host:
            lines.append(f"- {r['size']} {_pe(r)}, host (own CPU time per step): {host}")
    return lines


_SECTION_RENDER = {"correctness": _correctness, "kernel_speed": _speed, "sweep": _sweep,
                   "end_to_end": _e2e}


def plots(data: dict, out_dir: Path) -> list[str]:
    """kernel_speed.png and end_to_end.png; returns the files written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    speed = attention_rows(data)
    groups = sorted({(r["D"], r["heads"]) for r in speed})
    if groups:
        fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.5), squeeze=False)
        for ax, (d, h) in zip(axes[0], groups):
            rows = [r for r in speed if (r["D"], r["heads"]) == (d, h)]
            for name in ("tape_fused", "tape_unfused", "rope_flash", "rope_cudnn"):
                pts = [(r["N"], r["methods"][name]["fwd_bwd_tflops"]) for r in rows
                       if "fwd_bwd_tflops" in r["methods"].get(name, {})]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=name)
            ax.set(xscale="log", xlabel="N", ylabel="fwd+bwd TFLOP/s", title=f"D={d}, {h} heads")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "kernel_speed.png", dpi=100)
        plt.close(fig)
        written.append("kernel_speed.png")
    e2e = [r for r in data["sections"].get("end_to_end", {}).get("results", [])
           if "tokens_per_s" in r]
    if e2e:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        labels = [f"{r['size']}\n{_pe(r)} mb{r['micro_batch']}" for r in e2e]
        ax.bar(labels, [r["tokens_per_s"] for r in e2e])
        ax.set(ylabel="tokens/s", title="end-to-end training, N=%d" % e2e[0]["seq_len"])
        fig.tight_layout()
        fig.savefig(out_dir / "end_to_end.png", dpi=100)
        plt.close(fig)
        written.append("end_to_end.png")
    return written
