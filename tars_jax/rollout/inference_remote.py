r"""The inference service as a separate process behind HTTP, with the in-process client API
(report section 2.5.3: the policy served apart from the trainer; multi-host rollouts).
`experiments/serve.py` starts the server; trainers and evaluation connect with
`--config.rollout.inference=<url>` / `--inference <url>`.

The server wraps one `InferenceService` (continuous batching over KV-cache slots) in FastAPI:

  POST /generate  {"ids": [int], "images": [base64 PNG], "key": [2] | null, "max_new_tokens": int | null}
                  -> {"tokens", "logprobs", "states", "versions", "request_id"}
  POST /release   {"session": str}: the episode ended, its slot's context is dropped
  POST /weights   msgpack of the policy params' leaves in tree order (`params_to_bytes`), header
                  `x-policy-version`: served from the next decode step on (`set_params`); a version
                  older than the one served is refused (409, StaleWeights) unless header
                  `x-policy-reset: 1` (a trainer's first push: a resumed run may be behind)
  POST /weights/checkpoint {"path": run dir or step dir, "version": int, "reset": bool}: the same from
                  an Orbax checkpoint the server can read (large models: nothing crosses the socket)
  GET  /health    {"version", "model" (`Parts.served_model_id`), "slots", "occupancy", "requests", "steps"}

`RemoteInference(url)` has the service's client API — `submit` (a `concurrent.futures.Future`),
`await generate(...)`, `act(prompts, images)`, `release(session)`, `set_params(params, version)`,
`version` — so
`rollout/pool.py` and `agent_loop.run_episodes` take either. A request that does not fit raises
`ContextTooLong` on the client, as in process (HTTP 413 with the lengths). Given `expect_model`, the
client refuses a server of another model at construction (`ModelMismatch`, naming both ids).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io

import numpy as np
from fastapi import FastAPI, HTTPException, Request  # module level: FastAPI resolves the annotation from here
from fastapi.responses import JSONResponse

from envs_bridge import protocol
from tars_jax.rollout.episode import InferenceUnavailable
from tars_jax.rollout.inference_server import ContextTooLong, Reply


def _png(image: np.ndarray) -> str:
  from PIL import Image
  buf = io.BytesIO()
  Image.fromarray(np.asarray(image, np.uint8)).save(buf, format="PNG", compress_level=1)
  return base64.b64encode(buf.getvalue()).decode()


def _unpng(data: str) -> np.ndarray:
  from PIL import Image
  return np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"), np.uint8)


def params_to_bytes(params) -> bytes:
  """The leaves of a params pytree (e.g. an `nnx.State`) in tree order as msgpack (flax.serialization)."""
  import flax.serialization
  import jax
  return flax.serialization.msgpack_serialize([np.asarray(x) for x in jax.tree.leaves(params)])


def params_from_bytes(template, data: bytes):
  """`params_to_bytes` back into the structure of `template`. Raises ValueError when the leaf count,
  a shape or a dtype differs (weights of another model)."""
  import flax.serialization
  import jax
  leaves, treedef = jax.tree.flatten(template)
  new = flax.serialization.msgpack_restore(data)
  if len(new) != len(leaves):
    raise ValueError(f"{len(new)} weight arrays sent, the served model has {len(leaves)}")
  for i, (a, b) in enumerate(zip(new, leaves)):
    if a.shape != b.shape or a.dtype != b.dtype:
      raise ValueError(f"weight {i}: sent {a.dtype}{list(a.shape)}, served model has {b.dtype}{list(b.shape)}")
  return jax.tree.unflatten(treedef, [jax.numpy.asarray(a) for a in new])  # template leaves may be ShapeDtypeStructs


class ModelMismatch(ValueError):
  """The inference server serves another model than the client's config builds."""


class StaleWeights(ValueError):
  """A weight push older than the version the server serves (without reset)."""


TOKEN_ENV = "TARS_INFERENCE_TOKEN"  # bearer token of the inference server and its clients when not given


def make_app(service, restore_params=None, model_id: str = "", token: str | None = None):
  """FastAPI app serving `service` (an `InferenceService`). restore_params(path) -> params: how
  POST /weights/checkpoint reads a checkpoint (None: that route answers 501). model_id: the served
  model's `Parts.served_model_id()`, reported by /health for clients to compare. token: every route
  but /health needs `Authorization: Bearer <token>` (401 otherwise; `envs_bridge.app.BearerAuth`);
  None: no auth (bind loopback only: anyone who reaches the port can push weights)."""

  def stale(version: int, reset: bool):
    if not reset and version < service.version:
      return JSONResponse(status_code=409, content={"error": "StaleWeights", "version": version,
                                                    "serving": service.version})
    return None

  app = FastAPI(title="tars_jax inference service")
  if token:
    from envs_bridge.app import BearerAuth
    app.add_middleware(BearerAuth, token=token)

  @app.post("/generate")
  async def generate(body: dict):
    images = [_unpng(x) for x in body.get("images", [])]
    key = body.get("key")
    try:  # a full queue: the request waits for room (InferenceService.generate)
      r: Reply = await service.generate(body["ids"], images, None if key is None else np.asarray(key, np.uint32),
                                        body.get("max_new_tokens"), body.get("session"))
    except ContextTooLong as e:
      return JSONResponse(status_code=413, content={"error": "ContextTooLong", "prompt_tokens": e.prompt_tokens,
                                                    "max_new_tokens": e.max_new_tokens, "capacity": e.capacity})
    except ValueError as e:
      raise HTTPException(status_code=422, detail=str(e))
    return {"tokens": r.tokens, "logprobs": r.logprobs.tolist(), "states": r.states.tolist(),
            "versions": r.versions.tolist(), "request_id": r.request_id}

  @app.post("/release")
  async def release(body: dict):
    service.release(body["session"])
    return {}

  @app.post("/weights")
  async def weights(request: Request):
    version = int(request.headers["x-policy-version"])
    refused = stale(version, request.headers.get("x-policy-reset") == "1")
    if refused is not None:
      return refused
    try:
      params = params_from_bytes(service.param_template, await request.body())
    except ValueError as e:
      raise HTTPException(status_code=422, detail=str(e))
    service.set_params(params, version)
    return {"version": version}

  @app.post("/weights/checkpoint")
  async def weights_checkpoint(body: dict):
    if restore_params is None:
      raise HTTPException(status_code=501, detail="this server was started without a checkpoint reader")
    refused = stale(int(body["version"]), bool(body.get("reset", False)))
    if refused is not None:
      return refused
    service.set_params(await asyncio.to_thread(restore_params, body["path"]), int(body["version"]))
    return {"version": int(body["version"])}

  @app.get("/health")
  async def health():
    s = service.stats
    return {"version": service.version, "model": model_id, "slots": service.n_slots, "occupancy": s.occupancy,
            "requests": s.requests, "steps": s.steps, "reused": s.reused}

  return app


class RemoteInference:
  """Client of an inference server process, with `InferenceService`'s API.

  url: the server's base URL; token: its bearer token (None: the env var TOKEN_ENV). The version it
  reports is the one it last set (`set_params`) or read from /health at construction; every reply
  carries the server's per-token versions.
  expect_model: the client's `Parts.served_model_id()`; a server reporting another raises ModelMismatch.
  Raises: InferenceUnavailable from any call the server does not answer within timeout_s (refused,
  reset, timed out); at construction ModelMismatch; from submit / generate / act ContextTooLong
  (HTTP 413), ValueError (422); from pushes StaleWeights (409); Unauthorized (401) for a wrong token.
  """

  def __init__(self, url: str, timeout_s: float = 600.0, expect_model: str | None = None,
               token: str | None = None):
    import httpx
    self.url = url.rstrip("/")
    token = protocol.resolve_token(token, TOKEN_ENV)
    self._headers = {"Authorization": f"Bearer {token}"} if token else {}
    self._sync = httpx.Client(base_url=self.url, timeout=timeout_s, headers=self._headers)
    self._async = None
    self._timeout = timeout_s
    try:
      health = self._health()
    except InferenceUnavailable:
      self._sync.close()
      raise
    if expect_model is not None and health.get("model") != expect_model:
      self._sync.close()
      raise ModelMismatch(f"the inference server at {self.url} serves model {health.get('model')!r}, this config "
                          f"builds model {expect_model!r} (architecture, tokenizer, grammar, screenshot size or "
                          "system prompt differ): start the server with the same config")
    self._version = int(health["version"])
    self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=32)

  @property
  def version(self) -> int:
    return self._version

  @staticmethod
  def _body(ids, images, key, max_new_tokens, session) -> dict:
    return {"ids": [int(x) for x in ids], "images": [_png(im) for im in images],
            "key": None if key is None else [int(x) for x in np.asarray(key, np.uint32)],
            "max_new_tokens": max_new_tokens, "session": session}

  def _reply(self, resp) -> Reply:
    self._check_auth(resp)
    if resp.status_code == 413:
      b = resp.json()
      raise ContextTooLong(b["prompt_tokens"], b["max_new_tokens"], b["capacity"])
    if resp.status_code == 422:
      raise ValueError(resp.json().get("detail"))
    resp.raise_for_status()
    b = resp.json()
    return Reply(b["tokens"], np.asarray(b["logprobs"], np.float32), np.asarray(b["states"], np.int32),
                 np.asarray(b["versions"], np.int32), b["request_id"])

  def _health(self) -> dict:
    """GET /health, its transport errors as InferenceUnavailable."""
    import httpx
    try:
      return self._sync.get("/health").raise_for_status().json()
    except httpx.TransportError as e:
      raise self._unavailable(e) from e

  def probe(self, timeout_s: float = 5.0) -> InferenceUnavailable | None:
    """None if GET /health answers within `timeout_s` seconds, else the InferenceUnavailable naming
    this client's URL (returned, not raised: for `distributed.on_peer_failure`, which asks what failed
    when a collective lost a peer)."""
    import httpx
    try:
      self._sync.get("/health", timeout=timeout_s).raise_for_status()
      return None
    except httpx.HTTPError as e:
      return self._unavailable(e, timeout_s)

  def _unavailable(self, e: BaseException, timeout_s: float | None = None) -> InferenceUnavailable:
    """The error naming this service; `timeout_s` the wait that ran out (default: the client's)."""
    return InferenceUnavailable(f"inference service at {self.url} unreachable or silent for "
                                f"{self._timeout if timeout_s is None else timeout_s} s: {type(e).__name__}: {e}")

  def _post(self, path: str, **kw):
    """`httpx.Client.post` with transport errors (refused, reset, timed out) as InferenceUnavailable."""
    import httpx
    try:
      return self._sync.post(path, **kw)
    except httpx.TransportError as e:
      raise self._unavailable(e) from e

  def submit(self, prompt_ids, images, key=None, max_new_tokens=None, session=None) -> concurrent.futures.Future:
    body = self._body(prompt_ids, images, key, max_new_tokens, session)
    return self._executor.submit(lambda: self._reply(self._post("/generate", json=body)))

  async def generate(self, prompt_ids, images, key=None, max_new_tokens=None, session: str | None = None) -> Reply:
    import httpx
    if self._async is None:  # bound to the running loop on first use
      self._async = httpx.AsyncClient(base_url=self.url, timeout=self._timeout, headers=self._headers)
    try:
      resp = await self._async.post("/generate", json=self._body(prompt_ids, images, key, max_new_tokens, session))
    except httpx.TransportError as e:
      raise self._unavailable(e) from e
    return self._reply(resp)

  def release(self, session: str) -> None:
    """The episode `session` ended (best-effort, in the background)."""
    self._executor.submit(lambda: self._post("/release", json={"session": session}))

  def act(self, prompts, images):
    futs = [self.submit(p, im) for p, im in zip(prompts, images)]
    return [(r.tokens, r.logprobs, r.states) for r in (f.result() for f in futs)]

  def set_params(self, params, version: int, reset: bool = False) -> None:
    """Ships `params` (msgpack) to the server, served as `version` from its next decode step.
    reset: accept a version older than the served one (a resumed trainer's first push).
    Raises ValueError (the server's reason) for weights of another model; StaleWeights for a version
    older than the served one without reset."""
    headers = {"x-policy-version": str(int(version)), "content-type": "application/octet-stream"}
    if reset:
      headers["x-policy-reset"] = "1"
    resp = self._post("/weights", content=params_to_bytes(params), headers=headers)
    self._check_push(resp)
    self._version = int(version)

  def refresh_version(self) -> int:
    """The version the server serves now (GET /health), kept as `version`: for clients that share a
    server another client pushes weights to (the processes of a multi-process trainer)."""
    self._version = int(self._health()["version"])
    return self._version

  def load_checkpoint(self, path: str, version: int, reset: bool = False) -> None:
    """The server restores its params from an Orbax checkpoint at `path` (run or step dir).
    Raises StaleWeights as `set_params`."""
    self._check_push(self._post("/weights/checkpoint", json={"path": path, "version": int(version),
                                                                  "reset": bool(reset)}))
    self._version = int(version)

  def _check_auth(self, resp) -> None:
    if resp.status_code == 401:
      raise protocol.Unauthorized(f"inference service at {self.url}: {resp.json().get('reason')} (token: the "
                                  f"client's token= or {TOKEN_ENV})")

  def _check_push(self, resp) -> None:
    self._check_auth(resp)
    if resp.status_code == 409:
      b = resp.json()
      raise StaleWeights(f"weights version {b['version']} refused by {self.url}: it serves version {b['serving']}")
    if resp.status_code == 422:
      raise ValueError(resp.json().get("detail"))
    resp.raise_for_status()

  def close(self) -> None:
    self._executor.shutdown(wait=False)
    self._sync.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
