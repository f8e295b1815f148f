"""PNG figures of a training run; ``asyncrl plot RUN_DIR`` calls ``plot_run``.

Inputs under ``RUN_DIR``: ``metrics.jsonl`` (trainer rows, required), ``metrics/eval.jsonl``,
``metrics/buffer.jsonl`` (cumulative staleness histograms) and ``metrics/rollout-<i>.jsonl``
(cumulative ``rollout/samples`` and ``rollout/tokens``, and the ``busy`` intervals since the
previous row). One PNG a figure (``reward``, ``training``, ``agent``, ``eval``,
``throughput``, ``staleness``, ``timeline``); one whose inputs are missing is skipped.
matplotlib is imported only when drawing (Agg backend, no display needed).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.observe.logs import get_logger

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

log = get_logger("asyncrl.plot")

Interval = tuple[float, float]
Row = dict[str, Any]
Series = dict[str, tuple[list[float], list[float]]]  # label -> (seconds, rate)

TRAINER_RATE_WINDOW = 5  # steps
REWARD_WINDOW_FRACTION = 0.1  # of the steps
_PASS_AT = re.compile(r"pass@(\d+)")
_BUSY, _WAIT = "tab:blue", "tab:orange"


@dataclass
class RunData:
    """The rows of one run directory (empty lists for optional files that are absent)."""

    trainer: list[Row]
    eval: list[Row] = field(default_factory=list)
    buffer: list[Row] = field(default_factory=list)
    rollouts: dict[str, list[Row]] = field(default_factory=dict)


# -- reading --------------------------------------------------------------------------------
def read_rows(path: Path) -> list[Row]:
    """JSON objects of a jsonl file; a line that is not one is skipped with a warning.

    The file may be being written by the running job, so a bad line (often a half-written
    last one) names the file and line in the warning and does not stop the plot.
    """
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            row, reason = None, str(exc)
        else:
            reason = f"a JSON {type(row).__name__}, not an object"
        if isinstance(row, dict):
            rows.append(row)
        else:
            log.warning("skipping malformed line", path=str(path), line=number, reason=reason)
    return rows


def load_run(run_dir: Path) -> RunData:
    """Every input file of ``run_dir``; FileNotFoundError when it has no metrics.jsonl."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory: it has no metrics.jsonl")
    extra = run_dir / "metrics"
    rollout_files = sorted(extra.glob("rollout-*.jsonl"), key=_actor_order)
    return RunData(
        trainer=[row for row in read_rows(metrics) if "step" in row],
        eval=_optional(extra / "eval.jsonl"),
        buffer=_optional(extra / "buffer.jsonl"),
        rollouts={path.stem: read_rows(path) for path in rollout_files},
    )


def _optional(path: Path) -> list[Row]:
    return read_rows(path) if path.is_file() else []


def _actor_order(path: Path) -> tuple[int, str]:
    """``rollout-2`` before ``rollout-10``."""
    suffix = path.stem.rpartition("-")[2]
    return (int(suffix) if suffix.isdigit() else -1, path.stem)


def _float(value: Any, default: float = math.nan) -> float:
    """``value`` as a float; ``default`` when it is null or not a number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return default


def _num(row: Row, key: str, default: float = math.nan) -> float:
    """``row[key]`` as a float; ``default`` when missing, null or not a number."""
    return _float(row.get(key), default)


# -- derived quantities (pure) --------------------------------------------------------------
def reward_window(steps: int) -> int:
    """The moving-average window: 10% of the steps, at least 1."""
    return max(1, round(REWARD_WINDOW_FRACTION * steps))


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean of the last ``window`` finite values at each index (NaN if none)."""
    out = []
    for i in range(len(values)):
        finite = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(finite) / len(finite) if finite else math.nan)
    return out


def monotone(counter: Sequence[float]) -> list[float]:
    """A cumulative counter made non-decreasing: after a drop (a restart from zero) the
    new values are added to the total reached before it."""
    out: list[float] = []
    offset = previous = 0.0
    for value in counter:
        if value < previous:
            offset += previous
        previous = value
        out.append(offset + value)
    return out


def windowed_rate(
    times: Sequence[float], cumulative: Sequence[float], window: int
) -> tuple[list[float], list[float]]:
    """``(t_i, (c_i - c_j) / (t_i - t_j))`` for ``i >= 1``, ``j = max(0, i - window)``.

    Points whose time span is not positive are left out.
    """
    xs, rates = [], []
    for i in range(1, len(times)):
        j = max(0, i - window)
        dt = times[i] - times[j]
        if dt > 0:
            xs.append(times[i])
            rates.append((cumulative[i] - cumulative[j]) / dt)
    return xs, rates


def trainer_intervals(rows: Iterable[Row]) -> tuple[list[Interval], list[Interval]]:
    """(busy, waiting) intervals of the trainer from its metrics rows.

    A row is written at ``time`` right after the step and its publish, so the trainer was
    busy in ``[time - publish - step, time]`` and waiting for data in the ``wait_data``
    seconds before that. Rows without ``time`` or ``time/step`` are left out.
    """
    busy, waiting = [], []
    for row in rows:
        end, step = _num(row, "time"), _num(row, "time/step")
        if not (math.isfinite(end) and math.isfinite(step)):
            continue
        start = end - _num(row, "time/publish", 0.0) - step
        busy.append((start, end))
        wait = _num(row, "time/wait_data", 0.0)
        if wait > 0:
            waiting.append((start - wait, start))
    return busy, waiting


def rollout_intervals(rows: Iterable[Row]) -> list[Interval]:
    """The ``busy`` [start, end] intervals of a rollout actor's rows (malformed ones left out)."""
    out = []
    for row in rows:
        for pair in row.get("busy") or []:
            if isinstance(pair, list) and len(pair) == 2:
                start, end = _float(pair[0]), _float(pair[1])
                if math.isfinite(start) and math.isfinite(end) and end >= start:
                    out.append((start, end))
    return out


def run_span(lanes: Iterable[Iterable[Interval]]) -> Interval | None:
    """(first start, last end) over every interval of every lane; None if there are none."""
    intervals = [iv for lane in lanes for iv in lane]
    if not intervals:
        return None
    return min(s for s, _ in intervals), max(e for _, e in intervals)


def union_length(intervals: Iterable[Interval], span: Interval) -> float:
    """Total length of the union of ``intervals`` clipped to ``span`` (overlaps count once)."""
    lo, hi = span
    total, reach = 0.0, lo
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total += end - start
            reach = end
    return total


def busy_fraction(intervals: Iterable[Interval], span: Interval) -> float:
    """``|union of intervals within span| / |span|``; 0 for an empty span."""
    length = span[1] - span[0]
    return union_length(intervals, span) / length if length > 0 else 0.0


def last_histogram(rows: Sequence[Row], key: str) -> dict[int, float]:
    """The last row's cumulative histogram ``key`` as {staleness: count}, sorted by staleness.

    Rows without the key (or with a non-dict value) are passed over; {} if none has it.
    """
    for row in reversed(rows):
        hist = row.get(key)
        if isinstance(hist, dict):
            counts = {int(k): _float(n, 0.0) for k, n in hist.items() if _is_int(k)}
            return dict(sorted(counts.items()))
    return {}


def _is_int(key: Any) -> bool:
    return str(key).removeprefix("-").isdigit()


def histogram_mean(hist: dict[int, float]) -> float:
    """``sum(k * n_k) / sum(n_k)``; NaN for an empty histogram."""
    total = sum(hist.values())
    return sum(k * n for k, n in hist.items()) / total if total > 0 else math.nan


def eval_curves(rows: Iterable[Row]) -> dict[str, dict[int, list[tuple[float, float]]]]:
    """{set: {K: [(version, pass@K), ...] sorted by version}} from eval rows.

    Only plain ``pass@K`` keys count (not ``pass@1/<group>``); a later row for the same
    (set, version) replaces an earlier one.
    """
    points: dict[str, dict[int, dict[float, float]]] = {}
    for row in rows:
        version = _num(row, "version")
        if not math.isfinite(version):
            continue
        curves = points.setdefault(str(row.get("set", "eval")), {})
        for key in row:
            match = _PASS_AT.fullmatch(key)
            if match and math.isfinite(value := _num(row, key)):
                curves.setdefault(int(match[1]), {})[version] = value
    return {
        name: {k: sorted(by_version.items()) for k, by_version in sorted(curves.items())}
        for name, curves in points.items()
    }


def run_start(run: RunData) -> float:
    """Unix time of the run's first event: the earliest interval start or row time."""
    rows = itertools.chain(run.trainer, run.buffer, *run.rollouts.values())
    times = [t for t in (_num(r, "time") for r in rows) if math.isfinite(t)]
    starts = [s for lane in _lanes(run).values() for s, _ in lane]
    return min(starts + times, default=0.0)


def busy_fractions(run: RunData) -> dict[str, float]:
    """``busy_fraction`` of every timeline lane over the span of all lanes (see ``_lanes``)."""
    lanes = _lanes(run)
    span = run_span(lanes.values())
    return {name: busy_fraction(lane, span) if span else 0.0 for name, lane in lanes.items()}


def _lanes(run: RunData) -> dict[str, list[Interval]]:
    """Busy intervals per lane: each rollout actor, the trainer, and the trainer's waits."""
    busy, waiting = trainer_intervals(run.trainer)
    lanes = {name: rollout_intervals(rows) for name, rows in run.rollouts.items()}
    return {**lanes, "trainer": busy, "trainer/wait": waiting}


# -- drawing --------------------------------------------------------------------------------
def plot_run(run_dir: Path, out_dir: Path) -> list[Path]:
    """Draw every figure whose inputs exist into ``out_dir``; returns the written paths.

    Raises FileNotFoundError when ``run_dir`` has no metrics.jsonl.
    """
    run = load_run(Path(run_dir))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    drawers = {
        "reward": _reward_figure,
        "training": _training_figure,
        "agent": _agent_figure,
        "eval": _eval_figure,
        "throughput": _throughput_figure,
        "staleness": _staleness_figure,
        "timeline": _timeline_figure,
    }
    written = []
    for name, draw in drawers.items():
        if (fig := draw(run)) is not None:
            fig.savefig(path := out_dir / f"{name}.png", dpi=100)
            written.append(path)
    return written


def _figure(rows: int = 1, height: float = 4.0) -> tuple[Figure, list[Axes]]:
    """A new Agg figure with ``rows`` stacked axes sharing x (no pyplot state)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, height * rows), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, list(axes)


def _reward_figure(run: RunData) -> Figure | None:
    """``reward.png``: ``reward/mean`` per step and its trailing moving average over
    ``reward_window(steps)`` steps (non-finite values left out of each mean)."""
    steps = [_num(r, "step") for r in run.trainer]
    rewards = [_num(r, "reward/mean") for r in run.trainer]
    if not any(math.isfinite(r) for r in rewards):
        return None
    window = reward_window(len(rewards))
    fig, (ax,) = _figure()
    ax.plot(steps, rewards, color="tab:blue", alpha=0.3, lw=1, label="reward/mean")
    ax.plot(
        steps,
        moving_average(rewards, window),
        color="tab:blue",
        lw=2,
        label=f"moving average ({window} steps)",
    )
    ax.set(xlabel="step", ylabel="mean reward", title="trainer reward per step")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


#: Panels of ``training.png``: title and the trainer keys drawn in it.
TRAINING_PANELS = (
    ("KL", ("kl", "mismatch_kl")),
    ("entropy", ("entropy",)),
    ("response length (loss tokens)", ("response_len/mean",)),
    ("truncated share", ("response/truncated",)),
    ("clip fraction", ("clip_frac",)),
    ("grad norm (before clipping)", ("grad_norm",)),
)


#: Panels of ``agent.png`` (``observe/episodes.py``'s metrics).
AGENT_PANELS = (
    ("turns and tool calls per episode", ("agent/turns", "agent/tool_calls")),
    ("tool errors and timeouts (share of calls)", ("agent/tool_errors", "agent/tool_timeouts")),
    ("tool latency (s a call)", ("agent/tool_latency_s",)),
    ("sampled tokens per turn", ("agent/tokens_per_turn",)),
    ("episodes ended by the token budget or the context", ("agent/context_ended",)),
)


def _training_figure(run: RunData) -> Figure | None:
    """``training.png``: ``TRAINING_PANELS`` against the step, then the trained reward
    beside every scored sample's before the filters."""
    return _panels_figure(run, TRAINING_PANELS, with_rewards=True)


def _agent_figure(run: RunData) -> Figure | None:
    """``agent.png`` (agent runs): ``AGENT_PANELS`` against the step."""
    return _panels_figure(run, AGENT_PANELS, with_rewards=False)


def _panels_figure(
    run: RunData, spec: Sequence[tuple[str, tuple[str, ...]]], *, with_rewards: bool
) -> Figure | None:
    """One panel per entry of ``spec`` with a key present (none present: no figure)."""
    steps = [_num(r, "step") for r in run.trainer]
    panels = [
        (title, [k for k in keys if any(k in r for r in run.trainer)]) for title, keys in spec
    ]
    panels = [(title, keys) for title, keys in panels if keys]
    if not panels:
        return None
    fig, axes = _figure(rows=len(panels) + with_rewards, height=2.2)
    for ax, (title, keys) in zip(axes, panels, strict=False):
        for key in keys:
            ax.plot(steps, [_num(r, key) for r in run.trainer], lw=1.5, label=key)
        ax.set(title=title)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    if with_rewards:
        _rewards_before_filters(axes[-1], run, steps)
    axes[-1].set(xlabel="step")
    return fig


def _rewards_before_filters(ax: Axes, run: RunData, steps: list[float]) -> None:
    """The trained reward per step, and every scored sample's before the filters (the
    rollout rows' ``rollout/reward_mean``, drawn at the version their engines served)."""
    ax.plot(steps, [_num(r, "reward/mean") for r in run.trainer], lw=1.5, label="trained")
    for name, rows in run.rollouts.items():
        points = [(_num(r, "version"), _num(r, "rollout/reward_mean")) for r in rows]
        points = [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]
        if points:
            _line(ax, points, lw=1, ls="--", label=f"{name}, before filters")
    ax.set(title="mean reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")


def _eval_figure(run: RunData) -> Figure | None:
    """``eval.png``: each set's ``pass@1`` against the weight version (solid), and
    ``pass@K`` for its largest ``K > 1`` (dashed, same colour)."""
    curves = eval_curves(run.eval)
    if not curves:
        return None
    fig, (ax,) = _figure()
    for (name, by_k), color in zip(curves.items(), itertools.cycle(_colors()), strict=False):
        if 1 in by_k:
            _line(ax, by_k[1], color=color, marker="o", label=f"{name} pass@1")
        if (k := max(by_k)) > 1:
            _line(ax, by_k[k], color=color, ls="--", marker=".", label=f"{name} pass@{k}")
    ax.set(xlabel="weight version", ylabel="pass rate", title="evaluation", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def _colors() -> list[str]:
    return [f"tab:{c}" for c in ("blue", "orange", "green", "red", "purple", "brown", "pink")]


def _line(ax: Axes, points: Sequence[tuple[float, float]], **style: Any) -> None:
    ax.plot([x for x, _ in points], [y for _, y in points], **style)


def _throughput_figure(run: RunData) -> Figure | None:
    """``throughput.png``: ``sample_rates`` and ``token_rates`` against seconds since the
    run's first event; a counter that drops (an actor restarted from zero) continues from
    its previous total."""
    t0 = run_start(run)
    panels = {"samples/s": sample_rates(run, t0), "tokens/s": token_rates(run, t0)}
    panels = {unit: series for unit, series in panels.items() if series}
    if not panels:
        return None
    fig, axes = _figure(rows=len(panels), height=3.5)
    for ax, (unit, series) in zip(axes, panels.items(), strict=True):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, label=label, lw=1.5)
        ax.set(ylabel=unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_title("throughput")
    axes[-1].set_xlabel("seconds since the first event")
    return fig


def _rate(
    times: Sequence[float], counter: Sequence[float], t0: float, window: int = 1
) -> tuple[list[float], list[float]]:
    """``windowed_rate`` of a cumulative counter over the points where both are finite."""
    points = [(t, c) for t, c in zip(times, counter, strict=True) if math.isfinite(t + c)]
    xs = [t - t0 for t, _ in points]
    return windowed_rate(xs, monotone([c for _, c in points]), window)


def _times(rows: Sequence[Row]) -> list[float]:
    return [_num(r, "time") for r in rows]


def sample_rates(run: RunData, t0: float) -> Series:
    """Trained samples/s (buffer histogram total) and generated samples/s per rollout actor."""
    totals = [_histogram_total(r, "buffer.staleness_samples") for r in run.buffer]
    series = {"trained (buffer)": _rate(_times(run.buffer), totals, t0)}
    for name, rows in run.rollouts.items():
        samples = [_num(r, "rollout/samples") for r in rows]
        series[f"generated ({name})"] = _rate(_times(rows), samples, t0)
    return {label: points for label, points in series.items() if points[0]}


def _histogram_total(row: Row, key: str) -> float:
    """Sum of the histogram ``row[key]``; NaN when the row has none."""
    hist = row.get(key)
    return sum(_float(n, 0.0) for n in hist.values()) if isinstance(hist, dict) else math.nan


def token_rates(run: RunData, t0: float) -> Series:
    """Trained tokens/s (per-step counts accumulated) and generated tokens/s per actor."""
    series: Series = {}
    for key, label in (("tokens", "trained, forwarded"), ("num_tokens", "trained, loss tokens")):
        counter = list(itertools.accumulate(_num(r, key, 0.0) for r in run.trainer))
        series[label] = _rate(_times(run.trainer), counter, t0, TRAINER_RATE_WINDOW)
    for name, rows in run.rollouts.items():
        tokens = [_num(r, "rollout/tokens") for r in rows]
        series[f"generated ({name})"] = _rate(_times(rows), tokens, t0)
    return {label: points for label, points in series.items() if points[0]}


def _staleness_figure(run: RunData) -> Figure | None:
    """``staleness.png``: the share of trained samples and tokens at each staleness, from
    the last buffer row's histograms; without buffer.jsonl, a histogram of the per-step
    ``staleness/mean``."""
    samples = last_histogram(run.buffer, "buffer.staleness_samples")
    tokens = last_histogram(run.buffer, "buffer.staleness_tokens")
    if samples or tokens:
        return _staleness_bars({"samples": samples, "tokens": tokens})
    per_step = [_num(r, "staleness/mean") for r in run.trainer]
    per_step = [v for v in per_step if math.isfinite(v)]
    if not per_step:
        return None
    fig, (ax,) = _figure()
    ax.hist(per_step, bins=min(30, max(5, len(per_step) // 5)), color="tab:blue")
    ax.set(
        xlabel="mean staleness of the step (versions)",
        ylabel="steps",
        title="staleness per trainer step (no buffer.jsonl)",
    )
    return fig


def _staleness_bars(hists: dict[str, dict[int, float]]) -> Figure:
    """Grouped bars: the share (%) of each histogram at each staleness."""
    fig, (ax,) = _figure()
    hists = {name: h for name, h in hists.items() if sum(h.values()) > 0}
    width = 0.8 / len(hists)
    for i, (name, hist) in enumerate(hists.items()):
        total = sum(hist.values())
        xs = [k + (i - (len(hists) - 1) / 2) * width for k in hist]
        label = f"{name} ({total:.0f}, mean {histogram_mean(hist):.2f})"
        ax.bar(xs, [100 * n / total for n in hist.values()], width=width, label=label)
    ax.set_xticks(sorted({k for h in hists.values() for k in h}))
    ax.set(
        xlabel="staleness (versions behind the trainer)",
        ylabel="share of trained (%)",
        title="staleness of trained data (whole run)",
    )
    ax.legend()
    return fig


def _timeline_figure(run: RunData) -> Figure | None:
    """``timeline.png``: one lane per rollout actor and one for the trainer (busy, and
    waiting for data: ``trainer_intervals``), each labelled with its ``busy_fraction``."""
    lanes, fractions = _lanes(run), busy_fractions(run)
    span = run_span(lanes.values())
    if span is None:
        return None
    names = [name for name in lanes if name != "trainer/wait"]
    fig, (ax,) = _figure(height=max(2.0, 0.6 * len(names) + 1.2))
    labels = []
    for y, name in enumerate(names):
        _bars(ax, lanes[name], span[0], y, color=_BUSY, label="busy" if y == 0 else None)
        labels.append(f"{name}\nbusy {fractions[name]:.0%}")
    trainer = names.index("trainer")
    _bars(ax, lanes["trainer/wait"], span[0], trainer, color=_WAIT, label="waiting for data")
    labels[trainer] += f", waiting {fractions['trainer/wait']:.0%}"
    ax.set_yticks(range(len(names)), labels)
    ax.set(
        xlabel="seconds since the first event",
        xlim=(0, span[1] - span[0]),
        title=f"actor timeline ({span[1] - span[0]:.0f} s; busy = share of the whole span)",
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return fig


def _bars(ax: Axes, lane: Sequence[Interval], t0: float, y: int, **style: Any) -> None:
    """One lane of ``lane``'s intervals at height ``y``, x in seconds since ``t0``."""
    ax.broken_barh([(s - t0, e - s) for s, e in lane], (y - 0.35, 0.7), **style)
