"""How this rank's messages are made and sent: the usual small object framed in one piece,
anything else the general way; a MAC for each destination."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _ops
from .. import _wire as w
from .._endpoint import (
    COPY_THRESHOLD,
)
from .._errors import (
    CodecError,
)
from ._common import (
    _COLL,
    _PICKLE,
    MAX_PAYLOAD,
    _check_size,
    _first_pass,
    _size,
)
from ._state import _CoreState


class _Sending(_CoreState):
    """How this rank's messages are made and sent: the usual small object framed in one piece,
    anything else the general way; a MAC for each destination."""

    def _hello(self, dst: int) -> bytes:
        """The first message on a stream connection to ``dst``, framed: this rank sends on
        it (MACed for ``dst`` in a keyed group). Until a connection's first message says
        who sends on it, its peer takes small messages only (TcpEndpoint)."""
        frames = w.encode(w.Message(w.HELLO, self.rank, self.group_id, 0, 0, 0, w.NO_ROOT),
                          self.key, dst)
        return w.stream_prefix(frames) + b"".join(frames)

    # -------------------------------------------------------------------------- sending

    def _send_raw(self, dst: int, kind: int, payload: bytes, seq: int = 0, rnd: int = 0,
                  op: int = 0, root: int = w.NO_ROOT) -> None:
        msg = w.Message(kind, self.rank, self.group_id, seq, rnd, op, root, payload=payload)
        # (a goodbye is the last message: see ZmqEndpoint.send_last)
        send = self.ep.send_last if kind == w.BYE else self.ep.send
        try:
            send(dst, w.encode(msg, self.key, dst))
        except Exception:  # a status or goodbye message is best effort
            pass

    def _post(self, sends: tuple[tuple[int, Any], ...], rnd: int, seq: int, opcode: int,
              root: int) -> int:
        if self._send_failed is not None:
            # this call sent a failure in place of an object already: its later sends carry
            # it too (recursive doubling's next partial result may be encodable again, and
            # a rank that got it would return a result the failure never reached)
            sends = tuple((d, self._send_failed) for d, _ in sends)
        obj = sends[0][1]
        each = False  # whether the destinations get different objects
        if len(sends) == 1:  # a non-root's one send: the usual
            dsts: Sequence[int] = (sends[0][0],)
        else:
            for _, o in sends:
                if o is not obj:
                    each = True
                    break
            dsts = [d for d, _ in sends]  # (else a root's result, the same for all)
        # the usual object pickled by w.dumps' first pass (the others go on from what it found)
        enc = _first_pass(obj) if self._fast and not each else None
        if type(enc) is bytes and len(enc) < COPY_THRESHOLD:  # the usual message
            # (_emit's first way, in line: this runs for every small call's send)
            self._xs.send_framed(dsts, w.stream_messages(  # type: ignore[union-attr]
                dsts, _COLL, self.rank, self.group_id, seq, rnd, opcode, root, _PICKLE, enc,
                self.key))
            n = len(enc)
        else:
            n = self._post_each(sends, each, dsts, rnd, seq, opcode, root, enc)
        self.sent += len(sends)
        return n  # (the bytes encoded, each object once: for the flight recorder)

    def _post_each(self, sends: tuple[tuple[int, Any], ...], each: bool, dsts: Sequence[int],
                   rnd: int, seq: int, opcode: int, root: int, enc: Any) -> int:
        """:meth:`_post` of the object of ``sends[0]`` to ``dsts``, or (``each``) of each
        object of ``sends`` to its destination, encoded once per object; ``enc``: what the
        first pickling pass found of the one object (see :meth:`_encoded`). An object this
        rank cannot encode is sent as its failure (:meth:`_unsendable`)."""
        groups: Any
        if not each:
            groups = ((sends[0][1], dsts),)
        else:
            by_obj: dict[int, tuple[Any, list[int]]] = {}
            for dst, o in sends:
                entry = by_obj.get(id(o))
                if entry is None:
                    by_obj[id(o)] = (o, [dst])
                else:
                    entry[1].append(dst)
            groups = by_obj.values()
        n = 0
        for obj, to in groups:
            try:
                payload, bufs = self._encoded(obj, enc)
            except CodecError as e:
                payload, bufs = self._unsendable(e, opcode)
            if bufs or len(payload) > MAX_PAYLOAD:
                payload, bufs = self._sized(payload, bufs, opcode)
            self._emit(w.COLL, to, seq, rnd, opcode, root, self.codec, payload, bufs)
            n += _size(payload, bufs)
        return n

    def _encoded(self, obj: Any, enc: Any = None) -> tuple[Any, tuple[Any, ...]]:
        """``obj`` in the group's codec: payload and out-of-band buffers. ``enc``: what a
        first pickling pass found of it, so that it is not pickled again for nothing (None:
        no pass; its bytes; w.LARGE: pickled again, large buffers out of band; or the
        exception pickling raised)."""
        if enc is None:
            return w.dumps(obj, self.codec)
        if type(enc) is bytes:
            return enc, ()
        if enc is w.LARGE:
            return w.dumps_large(obj)
        raise w.cannot_pickle(obj, enc) from enc

    def _emit(self, kind: int, to: Sequence[int], seq: int, rnd: int, op: int, root: int,
              codec: int, payload: Any, bufs: tuple[Any, ...]) -> None:
        """One message to each rank of ``to``: a small one in one piece where the endpoint
        takes the stream framing; else its frames, with a MAC for each destination."""
        xs = self._xs
        if xs is not None and not bufs and type(payload) is bytes \
                and len(payload) < COPY_THRESHOLD:
            xs.send_framed(to, w.stream_messages(to, kind, self.rank, self.group_id, seq, rnd,
                                                 op, root, codec, payload, self.key))
        else:
            self._send_signed(to, w.frames_for(to, kind, self.rank, self.group_id, seq, rnd,
                                               op, root, codec, payload, bufs, self.key))

    def _unsendable(self, e: CodecError, opcode: int) -> tuple[Any, tuple[Any, ...]]:
        """What a collective sends in place of an object this rank cannot encode: the
        failure, which every rank that gets it raises, as this one does when its plan is
        done (raising now would leave the others waiting for its part, or pairing it with
        this rank's next call). Only in a plan whose messages are a rank's object or a
        whole result (see _FAIL_IN_PLACE); in the others it is raised, and the others are
        told (the group breaks: it cannot stay in step)."""
        text = self._codec_text(e, opcode, self.seq - 1)
        if not self._in_place:
            raise CodecError(text)
        failed = _ops.Failed(text, "codec")
        if self._send_failed is None:
            self._send_failed = failed
        return w.dumps(failed, self.codec)

    def _folded_result(self, result: Any, opcode: int, seq: int) -> Any:
        """An all_reduce's result by recursive doubling, or the failure to raise where the
        codec cannot encode it: ranks that fold their value into a partner's get the result
        from it, and where it cannot send it they raise; every rank that holds the result
        looks, so that they all do."""
        if type(result) is _ops.Failed:
            return result
        try:
            w.dumps(result, self.codec)
        except CodecError as e:
            return _ops.Failed(self._codec_text(e, opcode, seq), "codec")
        return result

    def _codec_text(self, e: CodecError, opcode: int, seq: int) -> str:
        """What every rank of collective #``seq`` raises where this one cannot encode."""
        return f"{w.OP_NAME.get(opcode & 0xF, 'collective')} #{seq} on rank {self.rank}: {e}"

    def _sized(self, payload: Any, bufs: tuple[Any, ...], opcode: int
               ) -> tuple[Any, tuple[Any, ...]]:
        """``payload`` and ``bufs``, or, where they are more than a message may carry (the
        receivers would drop the stream), the failure to send instead (:meth:`_unsendable`)."""
        try:
            _check_size(payload, bufs)
        except CodecError as e:
            return self._unsendable(e, opcode)
        return payload, bufs

    def _send_signed(self, dsts: Sequence[int], each: list[list[Any]]) -> None:
        """Send ``each[i]`` to ``dsts[i]`` (one message, a MAC per destination). The frames
        but the MAC are the same objects in each: one that may change once the call returns
        (an array's memory) is copied here, once for all the destinations, where a
        transport, given one destination at a time, would copy it for each that queues it
        (a 64 MiB array broadcast to three ranks: three copies). The header still says what
        the sender passed (the receiver's arrays are writable)."""
        send = self.ep.send
        if len(each) > 1:
            shared = each[0][:-1]
            if not all(map(w.immutable, shared)):
                shared = [f if w.immutable(f) else bytes(f) for f in shared]
                each = [[*shared, f[-1]] for f in each]
        for d, frames in zip(dsts, each, strict=True):
            send(d, frames)
