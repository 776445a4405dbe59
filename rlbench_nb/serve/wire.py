"""The Tinker SDK's binary wire: `forward_backward` requests arrive as protobuf, and its results and `sample`'s go
back as protobuf (the SDK refuses JSON for those two). The schema is the SDK's own (`tinker.proto`), so what this
reads and writes is what the client writes and reads (its `proto/request_conv.py` and `response_conv.py`).

    datums, header = read_forward_backward(body)        # -> list[Datum], {"model_id", "seq_id", "loss_fn", ...}
    encode_forward_backward(per_datum, metrics)         # -> bytes
    encode_sample(sequences)                            # -> bytes
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_NUMPY = {1: np.float32, 2: np.int64, 3: np.int32}  # proto DType -> numpy (DTYPE_FLOAT32, INT64, INT32)
MAX_DATUM_TOKENS = 1 << 20  # one datum longer than this is refused, not allocated


class WireError(ValueError):
    """A request body this server cannot read: the message says which field and why."""


@dataclass
class Datum:
    tokens: np.ndarray                 # model_input, int64 [N]
    inputs: dict[str, np.ndarray]      # loss_fn_inputs by name, each [N] (float32; target_tokens int64)


def _pb():
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as e:  # the server side of the SDK's wire needs the SDK's schema
        raise ImportError("the Tinker server reads the SDK's protobuf schema: pip install 'rlbench-nb[serve]'") from e
    return tinker_public_pb2


def _tensor(msg, name: str) -> np.ndarray:
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise WireError(f"loss_fn_inputs['{name}'] has dtype {msg.dtype}: send float32 or int64 (TensorData)")
    shape = tuple(msg.shape)
    if msg.WhichOneof("encoding") == "sparse_csr":  # unlisted cells are 0 (the SDK's CSR for 2-D inputs)
        if len(shape) != 2:
            raise WireError(f"loss_fn_inputs['{name}'] is sparse with shape {shape}: sparse inputs are 2-D")
        dense = np.zeros(shape, dtype=dtype)
        values = np.frombuffer(msg.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        for row in range(shape[0]):
            dense[row, cols[crow[row]:crow[row + 1]]] = values[crow[row]:crow[row + 1]]
        return dense
    arr = np.frombuffer(msg.dense, dtype=dtype)
    if shape and int(np.prod(shape)) != arr.size:
        raise WireError(f"loss_fn_inputs['{name}'] says shape {shape} but holds {arr.size} values")
    return arr.reshape(shape) if shape else arr


def _datum(msg, i: int) -> Datum:
    parts = []
    for chunk in msg.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"datum {i}: model_input holds a {kind} chunk; this server trains on text tokens only")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
    if not 0 < len(tokens) <= MAX_DATUM_TOKENS:
        raise WireError(f"datum {i}: model_input has {len(tokens)} tokens (1 to {MAX_DATUM_TOKENS} are served)")
    inputs = {name: _tensor(t, name) for name, t in msg.loss_fn_inputs.items()}
    for name, arr in inputs.items():
        if arr.ndim != 1 or len(arr) != len(tokens):
            raise WireError(f"datum {i}: loss_fn_inputs['{name}'] has shape {arr.shape} but model_input has "
                            f"{len(tokens)} tokens: each input is one value per position, shape ({len(tokens)},)")
    return Datum(tokens, inputs)


def read_forward_backward(body: bytes) -> tuple[list[Datum], dict]:
    """A ForwardBackwardRequest: its datums and header (model_id, seq_id, loss_fn, loss_fn_config, forward_only)."""
    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError: a body that is not the SDK's
        raise WireError(f"the forward_backward body is not a ForwardBackwardRequest protobuf ({e})") from e
    config = {k: v for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # v2 carries strings too; numbers are in both
        config[k] = v.number if v.WhichOneof("value") == "number" else v.text
    header = {"model_id": msg.model_id, "seq_id": msg.seq_id, "loss_fn": msg.loss_fn, "loss_fn_config": config,
              "forward_only": msg.forward_only}
    try:
        return [_datum(d, i) for i, d in enumerate(msg.data)], header
    except WireError:
        raise
    except (ValueError, IndexError) as e:  # buffers of a length or index the declared dtype and shape cannot hold
        raise WireError(f"a datum's tensors do not fit their declared dtype and shape ({e})") from e


def _batched(arrays: list[np.ndarray], pb):
    flat = [np.ascontiguousarray(a, dtype=np.float32) for a in arrays]
    offsets = np.cumsum([0] + [a.nbytes for a in flat]).astype(np.int64)
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in flat), offsets=offsets.tobytes(),
                            dtype=pb.DTYPE_FLOAT32)


def encode_forward_backward(outputs: dict[str, list[np.ndarray]], metrics: dict[str, float]) -> bytes:
    """`outputs`: field name -> one float array per datum (logprobs, elementwise_loss). Metric keys are
    `name:reduction` (the SDK splits on the one colon to merge chunks)."""
    pb = _pb()
    n = len(next(iter(outputs.values()))) if outputs else 0
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=n)
    for name, arrays in outputs.items():
        record.fields[name].CopyFrom(_batched(arrays, pb))
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


def encode_sample(sequences: list[tuple[list[int], list[float], bool]]) -> bytes:
    """(tokens, logprobs, stopped) per sampled sequence: `stopped` is a stop sequence or EOS, else the length cap."""
    pb = _pb()
    out = pb.SampleResponse()
    for tokens, logprobs, stopped in sequences:
        out.sequences.append(pb.SampledSequence(
            stop_reason=pb.STOP_REASON_STOP if stopped else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(logprobs, dtype=np.float32).tobytes()))
    return out.SerializeToString()
