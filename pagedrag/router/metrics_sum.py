"""One /metrics and one /v1/stats for several replicas.

/metrics: each replica's series with a ``replica`` label, and the sum over replicas without
it (for counters and histograms one that never goes down: ``CumulativeMemory``; the mean for
the usage fractions, ``*_perc``; the largest for a gauge of the disk tier,
one directory that the replicas share, so its use and capacity are not theirs to add), so that
a dashboard built for one engine reads the whole deployment unchanged. Creation-time series
(``*_created``) are left out.
/v1/stats: the counts summed, fractions averaged, the hit rate recomputed from the sums,
settings (block size, max_model_len, device) as the first replica has them; each replica's
own under ``replicas``. The KV tiers' figures (``kv_tiers``) by the same rules as /metrics:
traffic summed, the disk tier's use and capacity the largest, the cost model's per-token and
per-block seconds the median of the replicas that measured them. The same sums (``sum_fields``) make one /v1/warm answer of the
replicas' (router.warm_fanout)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

_MEAN_SUFFIX = "_perc"  # fractions: averaged, not summed
_SHARED_LABEL = ("tier", "disk")  # gauges of the one directory the replicas share: the largest, not summed
_SETTINGS = {"block_size", "max_model_len", "device"}


_CUMULATIVE = ("counter", "histogram", "summary")  # series that only grow while a process lives


class CumulativeMemory:
    """Keeps the sums of cumulative series (counters, histograms) from ever going down: a
    replica that restarts starts its series from 0 again, and one that misses a scrape is not
    in it. For each series it holds each replica's last value and what that replica counted
    before its restarts (a value lower than the last one is a restart)."""

    def __init__(self) -> None:
        self._series: dict[tuple, dict[str, list[float]]] = defaultdict(dict)  # key -> replica -> [last, before]

    def total(self, key: tuple, values: Mapping[str, float]) -> float:
        """The series' sum over every replica ever seen, ``values`` (by replica) the newest."""
        seen = self._series[key]
        for replica, value in values.items():
            last, before = seen.get(replica, (0.0, 0.0))
            seen[replica] = [value, before + last if value < last else before]
        return sum(last + before for last, before in seen.values())


def merge_metrics(texts: Mapping[str, str], memory: CumulativeMemory | None = None) -> str:
    """Prometheus texts by replica name -> one Prometheus text. ``memory`` (the caller's,
    kept across scrapes) keeps the sums of cumulative series from going down when a replica
    restarts or misses a scrape; without it they are this scrape's sums."""
    memory = CumulativeMemory() if memory is None else memory
    families: dict[str, tuple[str, str, list[str]]] = {}
    totals: dict[str, dict[tuple, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created"):  # creation times: meaningless summed
                continue
            # the text format names a counter's family as its samples: with _total
            name = family.name + "_total" if family.type == "counter" else family.name
            _, _, lines = families.setdefault(name, (family.type, family.documentation, []))
            for sample in family.samples:
                lines.append(_line(sample.name, {**sample.labels, "replica": replica}, sample.value))
                totals[name][(sample.name, tuple(sorted(sample.labels.items())))][replica] = sample.value
    out = []
    for name, (kind, documentation, lines) in families.items():
        out.append(f"# HELP {name} {_escape_help(documentation)}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(lines)
        for (sample_name, labels), values in totals[name].items():
            total = memory.total((sample_name, labels), values) if kind in _CUMULATIVE else \
                _total(name, kind, labels, list(values.values()))
            out.append(_line(sample_name, dict(labels), total))
    return "\n".join(out) + "\n"


def _total(name: str, kind: str, labels: tuple, values: list[float]) -> float:
    """A gauge's value over the replicas: the mean of fractions, the largest of the shared
    disk tier's, else the sum."""
    if name.endswith(_MEAN_SUFFIX):
        return sum(values) / len(values)
    if kind == "gauge" and _SHARED_LABEL in labels:
        return max(values)
    return sum(values)


def _line(name: str, labels: Mapping[str, str], value: float) -> str:
    if not labels:
        return f"{name} {value!r}"
    inner = ",".join(f'{key}="{_escape_label(str(val))}"' for key, val in labels.items())
    return f"{name}{{{inner}}} {value!r}"


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def sum_fields(replies: Sequence[dict]) -> dict:
    """Replicas' JSON objects (at least one) -> one with the first one's keys: numbers summed,
    fractions (``*_perc``) averaged, settings and anything not a number in every reply as the
    first one has it."""
    merged: dict = {}
    for key in replies[0]:
        column = [entry.get(key) for entry in replies]
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in column)
        if key in _SETTINGS or not numbers:
            merged[key] = column[0]
        elif key.endswith(_MEAN_SUFFIX):
            merged[key] = sum(column) / len(column)
        else:
            merged[key] = sum(column)
    return merged


def merge_stats(replies: Mapping[str, dict]) -> dict:
    """Replicas' /v1/stats (by replica name, at least one) -> the deployment's."""
    merged = sum_fields(list(replies.values()))
    tiers = [reply["kv_tiers"] for reply in replies.values() if isinstance(reply.get("kv_tiers"), dict)]
    if tiers:
        merged["kv_tiers"] = _merge_kv_tiers(tiers)
    if merged.get("prefix_cache_queries"):
        merged["prefix_cache_hit_rate"] = merged["prefix_cache_hits"] / merged["prefix_cache_queries"]
    merged["replicas"] = dict(replies)
    return merged


def _merge_kv_tiers(snapshots: Sequence[dict]) -> dict:
    """Replicas' ``kv_tiers`` (``KVTiers.snapshot``) -> the deployment's."""
    merged = {key: _sum_by_key([snapshot.get(key) or {} for snapshot in snapshots])
              for key in ("hit_tokens", "bytes", "seconds")}
    for key in ("external_prefix_cache_queries", "external_prefix_cache_hits"):
        merged[key] = sum(snapshot.get(key) or 0 for snapshot in snapshots)
    names = {name for snapshot in snapshots for name in snapshot.get("tiers", {})}
    merged["tiers"] = {name: _merge_tier(name, [s["tiers"][name] for s in snapshots if name in s.get("tiers", {})])
                       for name in sorted(names)}
    figures = defaultdict(list)
    for snapshot in snapshots:
        for key, value in (snapshot.get("cost_model") or {}).items():
            if isinstance(value, (int, float)):
                figures[key].append(value)
    keys = {key for snapshot in snapshots for key in (snapshot.get("cost_model") or {})}
    merged["cost_model"] = {key: statistics.median(figures[key]) if figures[key] else None for key in sorted(keys)}
    return merged


def _merge_tier(name: str, tiers: Sequence[dict]) -> dict:
    """One store's use across replicas: the disk tier is one shared directory (the largest
    reading), a host tier each replica's own (summed); dropped files are each replica's finds."""
    combine = max if (_SHARED_LABEL[0], name) == _SHARED_LABEL else sum
    return {"enabled": any(tier.get("enabled") for tier in tiers),
            "used_bytes": combine(tier.get("used_bytes") or 0 for tier in tiers),
            "capacity_bytes": combine(tier.get("capacity_bytes") or 0 for tier in tiers),
            "dropped_files": sum(tier.get("dropped_files") or 0 for tier in tiers)}


def _sum_by_key(counts: Sequence[dict]) -> dict:
    total: dict = defaultdict(int)
    for entry in counts:
        for key, value in entry.items():
            total[key] += value
    return dict(total)
