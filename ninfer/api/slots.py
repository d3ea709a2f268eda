"""``POST /slots/{id}?action=save|restore|erase``: slot persistence (serving contract §1.10,
llama.cpp server's ``--slot-save-path``).

- ``save`` ``{"filename": NAME, "if_digest"?: DIGEST}``: the lane's retained session (its
  token ledger, KV and, on hybrid models, the recurrent state) is copied out at an engine step
  boundary and written to ``DIR/NAME`` (``ninfer.store.slot_file``: atomic, bound to this
  model and cache layout). ``{id_slot, filename, n_saved, n_written, session_digest,
  timings: {save_ms}}``.
- ``restore`` ``{"filename": NAME}``: the file is read and checked off the engine thread, then
  loaded into the lane, which evicts whatever it retained (to L2 when there is one) and then
  holds the restored session like any retained one: the next request that extends it reuses it.
  ``{id_slot, filename, n_restored, n_read, session_digest, timings: {restore_ms}}``.
- ``erase`` ``{"if_digest"?: DIGEST}``: the lane drops its session. ``{id_slot, n_erased}``.

Errors: 501 ``slot_persistence_disabled`` (no ``--slot-save-path``); 400 ``invalid_slot``,
``invalid_action`` (none, another, or ``action`` given twice), ``invalid_json`` (as every
route), ``invalid_request`` (body not a JSON object, ``if_digest`` not 16 hex digits),
``unknown_parameter`` (save takes ``filename`` / ``if_digest``, restore ``filename``, erase
``if_digest``), ``invalid_filename`` (missing, or not 1-128 bytes of ``[A-Za-z0-9._-]``, no
leading dot); 409 ``slot_busy`` (a request runs on the lane), ``slot_session_mismatch``
(``if_digest`` is not what the lane holds, checked at the same boundary as the action); 400
``slot_<action>_failed`` (nothing to save; a file that is missing, not a regular file, corrupt,
or from another model, cache layout (the KV dtype included) or backend; a session longer than
a lane; a restore with prefix reuse off; a save onto a directory); 500 ``slot_save_failed``
when the directory cannot be written (the old file, if any, stays). Slot files are read and
written one at a time (each holds a whole session in host memory). Every outcome past the
checks of the request itself is a ``slot.action`` event, also when the client went away before
the engine answered (a save then records ``client_disconnected``: nothing was written). A
hybrid lane's turn checkpoints travel with its session, and a speculative lane's pending MTP
rows (slot file version 3), so ``--spec mtp`` requests resume a restored session too.
"""
from __future__ import annotations

import functools
import os
import re
import time

import trio
from quart import g, request

from ..engine.requests import SlotCommand
from ..events import schema as ev
from ..engine.continuation import check_layout
from ..store.slot_file import SlotFileError, read_slot_file, valid_filename, write_slot_file
from .errors import ApiError
from .request_body import json_body

ACTIONS = ("save", "restore", "erase")
FIELDS = {"save": {"filename", "if_digest"}, "restore": {"filename"}, "erase": {"if_digest"}}
ENGINE_TIMEOUT_S = 300.0   # an engine that does not answer: 503, never a hung client
_DIGEST = re.compile(r"[0-9a-f]{16}")


class SlotHandler:
    def __init__(self, state):
        self.state = state
        # one slot file read or written at a time: each holds a whole session in host memory
        self._io = trio.Semaphore(1)

    async def handle(self, slot_id: str) -> dict:
        cfg = self.state.config
        if not cfg.slot_save_path:
            raise ApiError(501, "slot persistence is disabled: start the server with "
                           "--slot-save-path DIR", "slot_persistence_disabled")
        lanes = cfg.max_concurrency
        if not (slot_id.isascii() and slot_id.isdigit() and len(slot_id) <= 9
                and slot_id == str(int(slot_id)) and int(slot_id) < lanes):
            raise ApiError(400, f"no slot {slot_id!r}: slots are 0 .. {lanes - 1}",
                           "invalid_slot", "id_slot")
        lane = int(slot_id)
        asked = request.args.getlist("action")
        if len(asked) > 1:   # (not the first of them silently)
            raise ApiError(400, f"give ?action= once (got {len(asked)}: "
                           f"{', '.join(a[:40] for a in asked[:5])})", "invalid_action", "action")
        action = asked[0] if asked else None
        if action not in ACTIONS:
            got = "no ?action=" if action is None else f"action={action[:40]!r}"
            raise ApiError(400, f"action must be one of {', '.join(ACTIONS)} (got {got})",
                           "invalid_action", "action")
        # no body: {} (restore and save then want a filename); a bad one: as every route's
        body = await json_body() if (await request.get_data()).strip() else {}
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", "invalid_request")
        for k in body:
            if k not in FIELDS[action]:
                raise ApiError(400, f"unknown parameter '{k}' for action={action} (takes "
                               f"{', '.join(sorted(FIELDS[action]))})", "unknown_parameter", k)
        if_digest = body.get("if_digest")
        if if_digest is not None and not (isinstance(if_digest, str)
                                          and _DIGEST.fullmatch(if_digest)):
            raise ApiError(400, "'if_digest' must be a session_digest (16 lowercase hex "
                           "digits, as GET /slots shows)", "invalid_request", "if_digest")
        filename = body.get("filename")
        if action != "erase" and filename is None:
            raise ApiError(400, f"'filename' is required for action={action}",
                           "invalid_filename", "filename")
        if action != "erase" and not valid_filename(filename):
            raise ApiError(400, "'filename' must be 1-128 characters of A-Z a-z 0-9 . _ - "
                           "and not start with a dot", "invalid_filename", "filename")
        t0 = time.monotonic()
        rid = g.get("request_id", "")
        try:
            return await self._run(action, lane, filename or "", if_digest, t0, rid)
        except ApiError as err:
            self.state.bus.emit(ev.SlotAction(lane=lane, action=action, filename=filename or "",
                                              ok=False,
                                              code=err.code or "", tokens=0, bytes=0,
                                              duration_s=time.monotonic() - t0, session_digest="",
                                              http_request_id=rid))
            err.logged = True   # this record is the refusal's; no request.error besides
            raise

    async def _engine(self, cmd: SlotCommand, on_abandoned):
        """Run ``cmd`` on the engine and return its SlotResult (an ApiError when it failed).
        When this task is cancelled (the client went away) after the command was queued, the
        engine still carries it out; ``on_abandoned(result)`` then records it."""
        engine = self.state.engine
        if engine.fatal is not None:
            raise ApiError(503, "the engine stopped after an internal error",
                           "service_unavailable")
        done, box, gone = trio.Event(), [], []

        def deliver(res):
            box.append(res)
            done.set()
            if gone:
                on_abandoned(res)

        cmd.deliver = deliver
        engine.slot_command(cmd)
        try:
            with trio.move_on_after(ENGINE_TIMEOUT_S):
                while not done.is_set() and engine.fatal is None:
                    with trio.move_on_after(0.5):
                        await done.wait()
        except trio.Cancelled:
            gone.append(True)
            if box:
                on_abandoned(box[0])
            raise
        if not box:
            raise ApiError(503, "the engine stopped after an internal error"
                           if engine.fatal is not None else "the engine did not answer",
                           "service_unavailable")
        res = box[0]
        if not res.ok:
            status = 409 if res.code in ("slot_busy", "slot_session_mismatch") else 400
            raise ApiError(status, res.message, res.code)
        return res

    async def _run(self, action: str, lane: int, filename: str, if_digest, t0: float,
                   rid: str) -> dict:
        state = self.state
        path = os.path.join(state.config.slot_save_path, filename)
        identity = state.runtime_identity

        def abandoned(nbytes: int):
            def record(res):   # the client left; what the engine did is still logged
                state.bus.emit(ev.SlotAction(lane=lane, action=action, filename=filename,
                                             ok=res.ok and action != "save",
                                             code=res.code or ("client_disconnected"
                                                          if action == "save" else ""),
                                             tokens=res.tokens, bytes=nbytes,
                                             duration_s=time.monotonic() - t0,
                                             session_digest=res.session_digest,
                                             http_request_id=rid))
            return record

        if action == "restore":
            state.bus.flush()   # the lane table as the log has it (the engine re-checks)
            views = state.folds.state.lanes.views
            if lane < len(views) and views[lane].processing:
                raise ApiError(409, f"slot {lane} is serving a request", "slot_busy")
            if not state.config.prefix_reuse:
                raise ApiError(400, "prefix reuse is off (--no-prefix-reuse): a restored "
                               "session could never be reused", "slot_restore_failed")
            async with self._io:
                await self._spilled(filename)
                try:
                    image, n_read = await trio.to_thread.run_sync(functools.partial(
                        read_slot_file, path, identity,
                        functools.partial(check_layout, identity),
                        max_tokens=state.n_ctx - 1))
                except SlotFileError as exc:
                    raise ApiError(400, f"cannot restore {filename}: {exc}",
                                   "slot_restore_failed") from None
            res = await self._engine(SlotCommand("restore", lane, None, image=image,
                                                 filename=filename),
                                     abandoned(n_read))
            ms = (time.monotonic() - t0) * 1e3
            self._event(lane, action, filename, res.tokens, n_read, t0, res.session_digest, rid)
            return {"id_slot": lane, "filename": filename, "n_restored": res.tokens,
                    "n_read": n_read, "session_digest": res.session_digest,
                    "timings": {"restore_ms": round(ms, 3)}}
        res = await self._engine(SlotCommand(action, lane, None, if_digest=if_digest,
                                             filename=filename),
                                 abandoned(0))
        if action == "erase":
            self._event(lane, action, "", res.tokens, 0, t0, "", rid)
            return {"id_slot": lane, "n_erased": res.tokens}
        async with self._io:
            await self._spilled(filename)
            try:
                n_written = await trio.to_thread.run_sync(write_slot_file, path, res.image,
                                                          identity)
            except (IsADirectoryError, NotADirectoryError) as exc:
                raise ApiError(400, f"cannot write {filename}: {exc.strerror or exc}",
                               "slot_save_failed", "filename") from None
            except OSError as exc:
                raise ApiError(500, f"cannot write {filename}: {exc.strerror or exc}",
                               "slot_save_failed") from None
        ms = (time.monotonic() - t0) * 1e3
        self._event(lane, action, filename, res.tokens, n_written, t0, res.session_digest, rid)
        return {"id_slot": lane, "filename": filename, "n_saved": res.tokens,
                "n_written": n_written, "session_digest": res.session_digest,
                "timings": {"save_ms": round(ms, 3)}}

    async def _spilled(self, filename: str) -> None:
        """Let an auto-save of ``filename`` still queued land first (--auto-save-evicted), so
        a restore reads the session spilled last and a save is not overwritten by an older
        spill."""
        spiller = self.state.engine.spiller
        if spiller and spiller.pending(filename):
            await trio.to_thread.run_sync(spiller.wait_file, filename)

    def _event(self, lane, action, filename, tokens, nbytes, t0, digest, rid) -> None:
        self.state.bus.emit(ev.SlotAction(lane=lane, action=action, filename=filename, ok=True,
                                          code="", tokens=tokens, bytes=nbytes,
                                          duration_s=time.monotonic() - t0, session_digest=digest,
                                          http_request_id=rid))
