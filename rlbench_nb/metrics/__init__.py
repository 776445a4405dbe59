"""Metric history and sinks (JSONL, TensorBoard). Keys are `group/name`; docs/metrics.md lists them."""
from .sinks import JSONLSink, TensorBoardSink, read_jsonl
from .timeline import idle_fractions, overlap_fraction
