"""The HTTP side of the Tinker server: the routes the `tinker` SDK (0.38) calls, under /api/v1, on FastAPI.

Every route but `healthz` needs the server's API key in `X-API-Key` (the SDK sends TINKER_API_KEY there). Work
that touches the workers is a future (futures.py): the route answers at once with a request id, and
`retrieve_future` waits for the result. A request the server cannot read is a 400/413 with a message; one it can
read but refuses, or one whose work fails, comes back from `retrieve_future` as {"error", "category"}, which the
SDK raises as `RequestFailedError`. Nothing a client sends stops the server.
"""
from __future__ import annotations

import json
import secrets
import time
import uuid

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from ..errors import RLBenchError
from ..roles.tinker_ops import GradientsDropped
from .backend import TinkerBackend, TinkerUserError
from .futures import Batchable, Futures
from .wire import WireError, read_forward_backward

MAX_BODY_BYTES = 64 << 20  # the SDK sends forward_backward in chunks of at most ~5 MB
POLL_S = 25.0              # retrieve_future holds a pending request this long (the SDK waits 45 s per poll)
# what the SDK asks at its first call: plain API-key auth, httpx, uncompressed bodies, chunks sent in order
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
                 "parallel_fwdbwd_chunks": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False}
USER_ERRORS = (TinkerUserError, WireError, RLBenchError, FloatingPointError, ValueError, GradientsDropped)


router = APIRouter(prefix="/api/v1")


def make_app(backend: TinkerBackend, futures: Futures, api_key: str) -> FastAPI:
    """The routes below on an app whose state holds this server's backend, futures and key."""
    app = FastAPI(title="rlbench-nb Tinker API", docs_url=None, redoc_url=None)
    app.state.backend, app.state.futures, app.state.api_key = backend, futures, api_key
    app.middleware("http")(_guard)
    app.include_router(router)
    return app


async def _guard(request: Request, call_next):
    """The API key on every route but healthz (compared in constant time); a body over the limit refused unread."""
    if request.url.path.endswith("/healthz"):
        return await call_next(request)
    given, key = request.headers.get("x-api-key", ""), request.app.state.api_key
    if not secrets.compare_digest(given.encode(), key.encode()):
        return JSONResponse({"detail": "missing or wrong API key: set TINKER_API_KEY to the key this server "
                             "printed (srv.api_key in the notebook)"}, status_code=401)
    size = request.headers.get("content-length")
    if size is not None and int(size) > MAX_BODY_BYTES:
        return JSONResponse({"detail": f"request body of {int(size)} bytes is over this server's "
                             f"{MAX_BODY_BYTES} (send fewer datums a call)"}, status_code=413)
    return await call_next(request)


def _backend(request: Request) -> TinkerBackend:
    return request.app.state.backend


async def body(request: Request) -> dict:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise HTTPException(413, f"request body over {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(raw or b"{}")
    except ValueError as e:
        raise HTTPException(400, f"the body is not JSON ({e})") from e
    if not isinstance(data, dict):
        raise HTTPException(400, "the body must be a JSON object")
    return data


def need(data: dict, name: str, kind: type | tuple):
    if not isinstance(data.get(name), kind):
        raise HTTPException(400, f"field '{name}' is missing or not a {getattr(kind, '__name__', kind)}")
    return data[name]


def future(request: Request, fn, key=None, batch=None, **extra) -> dict:
    """Submit `fn`; `key` (the client's model and seq_id) makes a retried submit the same request."""
    key = key if key is None or key[-1] is not None else None
    return {"request_id": request.app.state.futures.submit(fn, key, batch), **extra}


# ---- session and config -------------------------------------------------------------------
@router.get("/healthz")
async def healthz():
    return {"status": "ok"}


@router.post("/client/config")
async def client_config():
    return CLIENT_CONFIG


@router.post("/client/dynamic_config")
async def dynamic_config():
    return {}


@router.post("/create_session")
async def create_session(request: Request):
    b, sid = _backend(request), f"sess-{uuid.uuid4().hex[:12]}"
    b.seen[sid] = time.monotonic()
    kind = f"LoRA rank {b.lora_rank}" if b.lora_rank else "full weights (model.lora.r=0)"
    return {"session_id": sid, "type": "create_session",
            "info_message": f"rlbench-nb serves {b.model_name}, {kind}, run {b.sess.run_dir}"}


@router.post("/session_heartbeat")
async def heartbeat(request: Request):
    sid = (await body(request)).get("session_id")
    if isinstance(sid, str):
        _backend(request).seen[sid] = time.monotonic()  # a client that stops beating lets go of its gradients
    return {"type": "session_heartbeat"}


@router.post("/telemetry")
async def telemetry():
    return {"status": "accepted"}


@router.post("/sessions/{session_id}/finish")
async def finish(request: Request, session_id: str):
    _backend(request).seen[session_id] = 0.0  # finished: gradients it left are dropped at the next training call
    return {}


@router.get("/get_server_capabilities")
async def capabilities(request: Request):
    name = _backend(request).model_name
    return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True}]}


# ---- training -----------------------------------------------------------------------------
@router.post("/create_model")
async def create_model(request: Request):
    backend = _backend(request)
    data = await body(request)
    sid, seq = need(data, "session_id", str), need(data, "model_seq_id", int)
    lora = data.get("lora_config") or {}
    model_id = f"{sid}:train:{seq}"
    return future(request, lambda: backend.create_model(model_id, data.get("base_model", ""), lora.get("rank")),
                  key=(model_id, 0), model_id=model_id)


@router.post("/get_info")
async def get_info(request: Request):
    data = await body(request)
    try:
        return _backend(request).info(need(data, "model_id", str))
    except TinkerUserError as e:
        raise HTTPException(404, str(e)) from e


@router.post("/forward_backward")
async def forward_backward(request: Request):
    backend = _backend(request)
    raw = await request.body()
    if request.headers.get("content-encoding", "").lower() == "zstd":
        import zstandard
        raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=MAX_BODY_BYTES)
    try:
        datums, h = read_forward_backward(raw)
    except WireError as e:
        raise HTTPException(400, str(e)) from e
    return future(request, lambda: backend.forward_backward(h["model_id"], datums, h["loss_fn"],
                                                            h["loss_fn_config"], h["forward_only"]),
                  key=(h["model_id"], h["seq_id"]), model_id=h["model_id"])


@router.post("/optim_step")
async def optim_step(request: Request):
    backend = _backend(request)
    data = await body(request)
    model_id = need(data, "model_id", str)
    params = data.get("adam_params")
    if params is None:
        raise HTTPException(400, "optim_step takes adam_params (AdamParams); other optimizers are not served")
    return future(request, lambda: backend.optim_step(model_id, params), key=(model_id, data.get("seq_id")),
                  model_id=model_id)


@router.post("/save_weights")
async def save_weights(request: Request):
    backend = _backend(request)
    data = await body(request)
    model_id, name = need(data, "model_id", str), need(data, "path", str)
    return future(request, lambda: backend.save(model_id, name, "weights"), key=(model_id, data.get("seq_id")),
                  model_id=model_id)


@router.post("/save_weights_for_sampler")
async def save_for_sampler(request: Request):
    backend = _backend(request)
    data = await body(request)
    model_id = need(data, "model_id", str)
    if data.get("path"):
        name = data["path"]
        return future(request, lambda: backend.save(model_id, name, "sampler_weights"),
                      key=(model_id, data.get("seq_id")), model_id=model_id)
    sampler_id = f"{model_id}:sample:{data.get('sampling_session_seq_id', uuid.uuid4().hex[:8])}"

    def snapshot():
        backend.model(model_id)
        backend.sampler(sampler_id, None, None)
        return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}
    return future(request, snapshot, key=(model_id, data.get("seq_id")), model_id=model_id)


@router.post("/load_weights")
async def load_weights(request: Request):
    backend = _backend(request)
    data = await body(request)
    path = need(data, "path", str)
    model_id = data.get("model_id") or f"{need(data, 'session_id', str)}:train:{need(data, 'model_seq_id', int)}"
    return future(request, lambda: backend.load(model_id, path), key=(model_id, data.get("seq_id", 0)),
                  model_id=model_id)


# ---- sampling -----------------------------------------------------------------------------
@router.post("/create_sampling_session")
async def create_sampling_session(request: Request):
    data = await body(request)
    sid = need(data, "session_id", str)
    sampler_id = f"{sid}:sample:{data.get('sampling_session_seq_id', uuid.uuid4().hex[:8])}"
    backend, futures = _backend(request), request.app.state.futures
    # in the queue's order: a sampler made after an optim_step was sent samples the weights after it
    rid = futures.submit(lambda: backend.sampler(sampler_id, data.get("model_path"), data.get("base_model")))
    while (done := await futures.wait_async(rid, POLL_S)) is None:
        pass
    if done[0] == "error":
        raise HTTPException(400, str(done[1]))
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


@router.get("/samplers/{sampler_id:path}")
async def get_sampler(request: Request, sampler_id: str):
    s = _backend(request).samplers.get(sampler_id)
    if s is None:
        raise HTTPException(404, f"no sampling session '{sampler_id}'")
    return {"sampler_id": sampler_id, "base_model": s.base_model, "model_path": s.model_path}


@router.post("/asample")
async def asample(request: Request):
    backend = _backend(request)
    data = await body(request)
    sampler_id, n = need(data, "sampling_session_id", str), need(data, "num_samples", int)
    for flag in ("prompt_logprobs", "topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if data.get(flag):
            raise HTTPException(400, f"{flag} is not served by rlbench-nb (per-token log-probs of the samples "
                                "are): leave it off")
    chunks = need(need(data, "prompt", dict), "chunks", list)
    if any(not isinstance(c, dict) or c.get("type") != "encoded_text" for c in chunks):
        raise HTTPException(400, "the prompt must be encoded_text chunks (token ids): images are not served")
    prompt = [t for c in chunks for t in c.get("tokens", [])]
    if not all(isinstance(t, int) for t in prompt):
        raise HTTPException(400, "prompt tokens must be integers")
    params = data.get("sampling_params") or {}
    ids = [f"{sampler_id}:{data.get('seq_id', 0)}:{i}" for i in range(n)]
    # one sampler's requests with the same settings share an engine call (unseeded: a seed is per request)
    group = None if params.get("seed") is not None else (sampler_id, json.dumps(params, sort_keys=True))
    key = (sampler_id, "s", data.get("seq_id"))
    if group is None:
        return future(request, lambda: backend.sample(sampler_id, prompt, n, params), key=key,
                      sample_sequence_ids=ids)
    return future(request, None, key=key, sample_sequence_ids=ids,
                  batch=Batchable(group, (sampler_id, prompt, n, params), backend.sample_many))


# ---- futures ------------------------------------------------------------------------------
@router.post("/retrieve_future")
async def retrieve_future(request: Request):
    """The request's result, waiting for it up to POLL_S (the SDK polls again at once after a try_again)."""
    rid, futures = need(await body(request), "request_id", str), request.app.state.futures
    if not futures.known(rid):
        return {"error": f"no request '{rid}' on this server (a restarted server forgets them)", "category": "user"}
    done = await futures.wait_async(rid, POLL_S)
    if done is None:
        return {"type": "try_again", "request_id": rid, "queue_state": "active"}
    state, value = done
    if state == "error":
        return {"error": f"{type(value).__name__}: {value}",
                "category": "user" if isinstance(value, USER_ERRORS) else "server"}
    if isinstance(value, bytes):
        return Response(content=value, media_type="application/x-protobuf")
    return value


# ---- the REST extras the cookbook touches -------------------------------------------------
@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(run_id: str, checkpoint_id: str):
    return {}  # kept: a checkpoint of the run directory is the researcher's to delete (sess / the shell)


@router.get("/training_runs/{run_id:path}")
async def training_run(request: Request, run_id: str):
    b = _backend(request)
    if run_id not in b.models:
        raise HTTPException(404, f"no training run '{run_id}'")
    return {"training_run_id": run_id, "base_model": b.model_name, "model_owner": "rlbench-nb",
            "is_lora": bool(b.lora_rank), "lora_rank": b.lora_rank, "last_request_time": "1970-01-01T00:00:00Z"}
