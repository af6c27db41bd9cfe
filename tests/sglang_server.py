"""A fake SGLang 0.5.23 HTTP server (HF model on CPU) for tests of the weight-refit client and of /generate.

Status codes, bodies and messages follow the 0.5.23 wheel (entrypoints/http_server.py, scheduler weight_updater.py);
payloads are decoded by SGLang's own MultiprocessingSerializer (SafeUnpickler) and FlattenedTensorBucket, so bytes
accepted here are bytes a real server accepts. Tests call ``start_server(model_dir)`` -> ``ServerHandle``; sglang is
imported only in the server process, so importing this module does not put the triton stub into the test process.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import inspect
import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import urlsplit

import requests
import torch

_TOP_K_ALL = 1 << 30  # the contract's top_k default ("all"); -1 means the same
_SESSION_MSG = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
    "the operation will not be performed.)\n"
)


def install_triton_stub() -> None:
    """sglang.srt.utils imports triton at top level, but the serializer never uses it and the CPU venv has none:
    when ``import triton`` fails, serve MagicMock modules for triton and its submodules."""
    try:
        import triton  # noqa: F401

        return
    except ImportError:
        pass
    import importlib.abc
    import importlib.machinery
    from unittest.mock import MagicMock

    class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
            if name == "triton" or name.startswith("triton."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
            mod = MagicMock(name=spec.name)
            mod.__name__, mod.__spec__, mod.__path__ = spec.name, spec, []
            return mod

        def exec_module(self, module: Any) -> None:
            pass

    sys.meta_path.append(_StubFinder())


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as flat uint8 (bit-exact comparison and hashing for any dtype)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


class FakeSGLang:
    """Model + server state. One lock serializes model use, as SGLang's model-update writer lock makes updates wait
    for in-flight generations."""

    def __init__(self, args: argparse.Namespace) -> None:
        import transformers

        install_triton_stub()
        from sglang.api.v1.api_types import GenerateRequest, JsonContractError
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        # the real scheduler patches before deserializing (CUDA device UUIDs); idempotent. NB: in a process that has
        # applied it, ForkingPickler can no longer serialize CPU tensors, which is fine here: we only deserialize.
        monkey_patch_torch_reductions()
        self.serializer, self.bucket_cls = MultiprocessingSerializer, FlattenedTensorBucket
        self.contract, self.contract_error = GenerateRequest, JsonContractError
        self.args = args
        self.model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        self.eos_ids: set[int] = set()
        for src in (self.model.config, getattr(self.model, "generation_config", None)):
            e = getattr(src, "eos_token_id", None)
            self.eos_ids.update([e] if isinstance(e, int) else (e or []))
        # remove_duplicate=False keeps a tied lm_head.weight addressable (it aliases the embedding)
        self.targets = dict(self.model.named_parameters(remove_duplicate=False))
        self.targets.update(self.model.named_buffers(remove_duplicate=False))
        self.lock = threading.RLock()
        self.weight_version, self.session_open = "default", False
        self.sessions_begun = self.sessions_ended = self.flushes = 0
        self.updates: list[dict[str, Any]] = []
        self.generate_requests: list[Any] = []

    def session(self, begin: bool) -> tuple[int, dict[str, Any]]:
        with self.lock:
            if begin == self.session_open:  # 0.5.23's exact texts
                msg = (
                    "a weight-update session is already open; call end_weight_update() first"
                    if begin
                    else "no weight-update session is open; call begin_weight_update() first"
                )
                return 400, {"success": False, "message": msg}
            self.session_open = begin
            self.sessions_begun += begin
            self.sessions_ended += not begin
            return 200, {"success": True, "message": "Success"}

    def _decode(self, entry: bytes, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
        obj = self.serializer.deserialize(entry)  # SafeUnpickler: blocked globals raise here
        if load_format == "flattened_bucket":  # as model_runner's _update_weights_from_flattened_bucket
            bucket = self.bucket_cls(flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"])
            return bucket.reconstruct_tensors()
        if load_format is None:
            return [(name, t) for name, t in obj]
        raise NotImplementedError(f"Unknown load_format={load_format}")

    def update(self, body: dict[str, Any], entries: list[bytes]) -> tuple[int, dict[str, Any]]:
        fmt, version = body.get("load_format"), body.get("weight_version")
        rec: dict[str, Any] = {
            "names": [],
            "num_entries": len(entries),
            "load_format": fmt,
            "flush_cache": bool(body.get("flush_cache", True)),
            "weight_version": version,
            "bucket_bytes": 0,
            "success": False,
            "message": "",
        }

        def fail(msg: str) -> tuple[int, dict[str, Any]]:
            rec["message"] = msg
            return 400, {"success": False, "message": msg}

        with self.lock:
            self.updates.append(rec)
            if not self.session_open and not self.args.no_sessions:
                return fail(_SESSION_MSG)
            if len(self.updates) == self.args.fail_update:
                return fail(f"injected failure on bucket {len(self.updates)}")
            if len(entries) != self.args.tp:  # a real server would IndexError (too few) or ignore extras
                return fail(f"serialized_named_tensors has {len(entries)} entries, server tp_size is {self.args.tp}")
            ranks = []
            for rank, entry in enumerate(entries):  # entry i is exactly what TP rank i deserializes
                try:
                    ranks.append(self._decode(entry, fmt))
                except Exception as e:
                    return fail(f"TP rank {rank} failed to deserialize: {type(e).__name__}: {e}")
            named = ranks[0]
            rec["names"] = [n for n, _ in named]
            rec["bucket_bytes"] = sum(t.numel() * t.element_size() for _, t in named)
            for rank, other in enumerate(ranks[1:], 1):  # unsharded full tensors: every rank must agree bit for bit
                if [n for n, _ in other] != rec["names"]:
                    return fail(f"TP rank {rank} decoded different names than rank 0")
                for (name, a), (_, b) in zip(named, other):
                    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(_raw(a), _raw(b)):
                        return fail(f"TP rank {rank} decoded different values for {name}")
            for name, t in named:  # validate all before writing anything, so a rejected bucket changes nothing
                dst = self.targets.get(name)
                if dst is None:
                    return fail(f"Failed to update parameter online: unknown parameter name {name}")
                if tuple(dst.shape) != tuple(t.shape):
                    return fail(
                        f"Failed to update parameter online: shape mismatch for {name}: "
                        f"got {tuple(t.shape)}, expected {tuple(dst.shape)}"
                    )
            with torch.no_grad():
                for name, t in named:
                    self.targets[name].copy_(t)  # casts to the served dtype, like SGLang's param.data.copy_
            msg = "Success"  # the 0.5.23 scheduler's text; the tokenizer manager appends the version
            if version is not None:
                self.weight_version = version
                msg += f" Weight version updated to {version}."
            rec.update(success=True, message=msg)
            return 200, {"success": True, "message": msg}

    def flush(self) -> tuple[int, str]:
        with self.lock:
            self.flushes += 1
            # a busy 0.5.23 server answers "Flush cache failed.\n"; the "pending requests" reason only goes to its log
            return (400, "Flush cache failed.\n") if self.flushes <= self.args.busy_flushes else (200, _FLUSHED)

    def generate(self, body: dict[str, Any]) -> Any:
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            raise ValueError("this fake server supports only non-empty `input_ids`")
        single = not isinstance(ids[0], list)
        rows: list[list[int]] = [ids] if single else ids

        def per_row(key: str, default: Any) -> list[Any]:  # a scalar/dict applies to all rows, a list is per row
            v = default if body.get(key) is None else body[key]
            if isinstance(v, list) and not single:
                if len(v) != len(rows):
                    raise ValueError(f"`{key}` has {len(v)} entries for a batch of {len(rows)}")
                return v
            return [v] * len(rows)

        cols = zip(
            rows,
            per_row("sampling_params", {}),
            per_row("return_logprob", False),
            per_row("logprob_start_len", -1),
            per_row("rid", None),
        )
        with self.lock:
            out = [self._generate_row(*c) for c in cols]
        return out[0] if single else out

    def _generate_row(
        self, prompt: list[int], sp: dict[str, Any], want_lp: bool, lp_start: int, rid: str | None
    ) -> dict[str, Any]:
        def param(key: str, default: Any) -> Any:  # the contract allows explicit nulls, meaning the default
            return default if sp.get(key) is None else sp[key]

        max_new, temp = param("max_new_tokens", 128), param("temperature", 1.0)
        top_k, top_p = param("top_k", _TOP_K_ALL), param("top_p", 1.0)
        greedy = temp <= 1e-6 or top_k == 1  # SGLang turns temperature 0 into top_k = 1
        stop = param("stop", [])
        stops = [stop] if isinstance(stop, str) else list(stop)
        stop_ids = self.eos_ids | set(param("stop_token_ids", []))
        ignore_eos = bool(param("ignore_eos", False))  # in 0.5.23 this disables stop_token_ids as well
        skip_special = param("skip_special_tokens", True)
        gen = torch.Generator().manual_seed(param("sampling_seed", int.from_bytes(os.urandom(7), "little")))
        out_ids: list[int] = []
        out_lps: list[float] = []
        finish: dict[str, Any] = {"type": "length", "length": max_new}
        text: str | None = None  # set when a stop string cut the text
        keep = None  # tokens whose decode is the text (None = all)
        # transformers 5.2x renamed the forward's past_key_values to cache (the old name warns on every call)
        cache_key = "cache" if "cache" in inspect.signature(type(self.model).forward).parameters else "past_key_values"
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([prompt]), use_cache=True)
            prompt_lp = torch.log_softmax(out.logits[0].float(), -1)  # input logprobs: raw logits, no temperature
            while len(out_ids) < max_new:
                # logprobs are of the tempered distribution; temperature 0 reports the raw logits' softmax
                scaled = out.logits[0, -1].float() / (temp if temp > 1e-6 else 1.0)
                tok = int(scaled.argmax()) if greedy else _sample(scaled, top_k, top_p, gen)
                out_ids.append(tok)
                out_lps.append(float(torch.log_softmax(scaled, -1)[tok]))
                decoded = self.tokenizer.decode(out_ids, skip_special_tokens=skip_special)
                hit = next((s for s in stops if s in decoded), None)
                if hit is not None:  # stop strings are checked before stop tokens, as update_finish_state does
                    finish, text = {"type": "stop", "matched": hit}, decoded[: decoded.index(hit)]
                    break
                if not ignore_eos and tok in stop_ids:  # output_ids keep the matched token, the text drops it
                    finish, keep = {"type": "stop", "matched": tok}, len(out_ids) - 1
                    break
                if len(out_ids) < max_new:
                    out = self.model(input_ids=torch.tensor([[tok]]), use_cache=True, **{cache_key: out[cache_key]})
        if text is None:
            text = self.tokenizer.decode(out_ids[:keep], skip_special_tokens=skip_special)
        meta: dict[str, Any] = {
            "id": rid or uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(out_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
        }
        if want_lp:
            # logprob_start_len -1 means output only: one input entry, the last prompt token. The first returned
            # input position always has a null logprob; later ones hold log p(tok_i | tok_<i).
            start = len(prompt) - 1 if lp_start < 0 else min(lp_start, len(prompt) - 1)
            meta["input_token_logprobs"] = [
                [None if i == start else float(prompt_lp[i - 1, prompt[i]]), prompt[i], None]
                for i in range(start, len(prompt))
            ]
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out_lps, out_ids)]
            meta["output_token_logprobs_length"] = len(out_ids)
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    def logprobs(self, input_ids: list[list[int]], lengths: list[int]) -> list[list[float]]:
        """NeMo convention: position 0 is 0, position i is log p(token_i | tokens_<i), zeros past each length."""
        ids, lens = torch.tensor(input_ids), torch.tensor(lengths)
        mask = (torch.arange(ids.shape[1])[None, :] < lens[:, None]).long()
        with self.lock, torch.no_grad():
            lp = torch.log_softmax(self.model(input_ids=ids, attention_mask=mask).logits.float(), -1)
        out = torch.zeros(ids.shape, dtype=torch.float32)
        out[:, 1:] = lp[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2)
        return (out * mask).tolist()

    def state_dict_sha(self) -> dict[str, str]:
        with self.lock:
            return {
                k: hashlib.sha256(_raw(v).numpy().tobytes()).hexdigest() for k, v in self.model.state_dict().items()
            }

    def state(self) -> dict[str, Any]:
        with self.lock:  # copies: the handler serializes after the lock is released
            return {
                "updates": [dict(u) for u in self.updates],
                "sessions_begun": self.sessions_begun,
                "sessions_ended": self.sessions_ended,
                "session_open": self.session_open,
                "flushes": self.flushes,
                "generate_requests": list(self.generate_requests),
                "weight_version": self.weight_version,
            }


def _sample(scaled: torch.Tensor, top_k: int, top_p: float, gen: torch.Generator) -> int:
    if 0 < top_k < scaled.numel():
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, top_k).values[-1], float("-inf"))
    if top_p < 1.0:  # keep the smallest prefix (by probability) whose mass reaches top_p
        srt, idx = torch.sort(scaled, descending=True)
        probs = torch.softmax(srt, -1)
        scaled = scaled.clone()
        scaled[idx[probs.cumsum(-1) - probs > top_p]] = float("-inf")
    return int(torch.multinomial(torch.softmax(scaled, -1), 1, generator=gen))


def make_handler(srv: FakeSGLang) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive like uvicorn, so every reply carries Content-Length

        def log_message(self, format: str, *args: Any) -> None:  # keep stderr for real errors
            pass

        def _send(self, code: int, body: Any, text: bool = False) -> None:
            data = body.encode() if text else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; charset=utf-8" if text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._route("GET", {})

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                body = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError as e:  # FastAPI answers malformed JSON with 422
                return self._send(422, {"detail": [{"type": "json_invalid", "msg": f"JSON decode error: {e}"}]})
            self._route("POST", body)

        def _route(self, method: str, body: Any) -> None:
            path, post = urlsplit(self.path).path, method == "POST"
            if path == "/health":
                return self._send(200, "", text=True)
            if path == "/model_info":
                cfg = srv.model.config
                return self._send(
                    200,
                    {
                        "model_path": srv.args.model,
                        "tokenizer_path": srv.args.model,
                        "served_model_name": srv.args.model,
                        "is_generation": True,
                        "weight_version": srv.weight_version,
                        "model_type": cfg.model_type,
                        "architectures": cfg.architectures,
                    },
                )
            if path == "/flush_cache":  # GET or POST
                return self._send(*srv.flush(), text=True)
            if path in ("/begin_weight_update", "/end_weight_update") and post:
                if srv.args.no_sessions:  # an older server: the routes do not exist
                    return self._send(404, {"detail": "Not Found"})
                return self._send(*srv.session(path == "/begin_weight_update"))
            if path == "/update_weights_from_tensor" and post:
                entries = body.get("serialized_named_tensors") if isinstance(body, dict) else None
                loc = ["body", "serialized_named_tensors"]
                if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
                    return self._send(422, {"detail": [{"type": "missing", "loc": loc, "msg": "Field required"}]})
                try:  # the HTTP layer's Base64Bytes: standard alphabet with padding, nothing else
                    raw = [base64.b64decode(e, validate=True) for e in entries]
                except binascii.Error:
                    return self._send(
                        422,
                        {
                            "detail": [
                                {"type": "value_error", "loc": loc, "msg": "Value error, Expected base64-encoded bytes"}
                            ]
                        },
                    )
                return self._send(*srv.update(body, raw))
            if path == "/generate" and post:
                with srv.lock:
                    srv.generate_requests.append(body)  # dropped ones too
                    drop = len(srv.generate_requests) <= srv.args.drop_first_generate
                if drop:  # no status line at all: the client sees the connection drop
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return None
                try:
                    srv.contract.from_json_value(body)  # SGLang's own contract check, e.g. unknown sampling keys
                except srv.contract_error as e:
                    return self._send(400, {"error": str(e)})
                try:
                    return self._send(200, srv.generate(body))
                except ValueError as e:  # SGLang's _create_error_response shape
                    return self._send(400, {"error": {"message": str(e)}})
            if path == "/dask_lm_test/logprobs" and post:
                return self._send(200, {"logprobs": srv.logprobs(body["input_ids"], body["input_lengths"])})
            if path == "/dask_lm_test/state":
                return self._send(200, srv.state())
            if path == "/dask_lm_test/state_dict_sha":
                return self._send(200, srv.state_dict_sha())
            return self._send(404, {"detail": "Not Found"})

    return Handler


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="fake SGLang 0.5.23 server for tests")
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on the READY line)")
    p.add_argument("--tp", type=int, default=1, help="serialized_named_tensors must have this many entries")
    p.add_argument("--fail-update", type=int, default=0, help="the K-th update call (1-based) answers 400")
    p.add_argument("--busy-flushes", type=int, default=0, help="the first K /flush_cache calls answer 400")
    p.add_argument("--no-sessions", action="store_true", help="begin/end 404 (older server); updates need none")
    p.add_argument("--drop-first-generate", type=int, default=0, help="drop the first K /generate connections")
    args = p.parse_args(argv)
    srv = FakeSGLang(args)
    httpd = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(srv))
    httpd.daemon_threads = True
    print(f"READY {httpd.server_address[1]}", flush=True)
    httpd.serve_forever()


class ServerHandle:
    """A running fake server: ``.url``, the test-route helpers and ``.stop()``; also a context manager."""

    def __init__(self, proc: subprocess.Popen, port: int, stderr_path: str) -> None:
        self.proc, self.port, self.stderr_path = proc, port, stderr_path
        self.url = f"http://127.0.0.1:{port}"

    def _call(self, method: str, route: str, body: Any = None) -> Any:
        r = requests.request(method, self.url + route, json=body, timeout=300)
        r.raise_for_status()
        return r.json()

    def state(self) -> dict[str, Any]:
        return self._call("GET", "/dask_lm_test/state")

    def logprobs(self, input_ids: Any, input_lengths: Any) -> torch.Tensor:
        ids, lens = (x.tolist() if hasattr(x, "tolist") else list(x) for x in (input_ids, input_lengths))
        out = self._call("POST", "/dask_lm_test/logprobs", {"input_ids": ids, "input_lengths": lens})
        return torch.tensor(out["logprobs"], dtype=torch.float32)

    def state_dict_sha(self) -> dict[str, str]:
        return self._call("POST", "/dask_lm_test/state_dict_sha")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        if os.path.exists(self.stderr_path):
            os.unlink(self.stderr_path)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(model_dir: str, *, tp: int = 1, extra_args: Sequence[str] = (), timeout: float = 120) -> ServerHandle:
    """Launch this script on a free port; return once it printed READY, else raise with its stderr."""
    fd, err_path = tempfile.mkstemp(prefix="fake_sglang_", suffix=".stderr")  # a file: a full pipe would block it
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--tp",
        str(tp),
        *map(str, extra_args),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=fd, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    )
    os.close(fd)
    handle, lines = ServerHandle(proc, 0, err_path), queue.Queue()

    def pump() -> None:  # readline with a timeout: a thread feeds a queue, "" marks EOF (the server exited)
        for ln in proc.stdout:  # type: ignore[union-attr]
            lines.put(ln)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    try:
        while line := lines.get(timeout=timeout):
            if line.startswith("READY "):
                handle.port = int(line.split()[1])
                handle.url = f"http://127.0.0.1:{handle.port}"
                return handle
    except queue.Empty:
        pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    with open(err_path, errors="replace") as f:
        stderr = f.read()
    handle.stop()
    raise RuntimeError(f"fake SGLang server did not become ready (exit code {proc.returncode}):\n{stderr}")


if __name__ == "__main__":
    main()
