"""The switch of a model's attention implementation to ``"hf_paged"`` while paged blocks run.

``switched(model)`` (``attention_interface.use_paged_attention``) switches the model for its block; nested and
concurrent blocks (threads generating on one model, an engine session beside patched generate) share one switch
per model: the first block switches, the last one out restores the model's own implementation.

While switched, a forward without a PagedCache (another thread's plain forward, the caller's own between a
stream's steps) still runs the model's own attention: the mask function hands it a ``DeferredMask``, which the
attention builds for the implementation the switch replaced (``attention_interface.replaced_attention``).
Such a mask must not outlive the switch: were the implementation restored between a forward's mask and its
attention, the restored attention would get a DeferredMask. So the switch counts the decoder forwards that
begin while it is on (an instance ``forward`` of the decoder, there only while switched, that counts from start
to end however the forward ends), and the last block out waits for them to end before it restores
(``CLOSE_WAIT_S`` at most, then restores anyway, saying so). Restoring removes everything the switch put on the
model: the implementation, the modules' fallback attributes, the decoder's forward and the switch itself (a
switched-off model deep-copies and pickles as before). A forward that entered the decoder in the moment before
the switch and builds its mask after it is not counted (a race measured at about 1 in 20,000-40,000 plain
forwards racing paged calls that start and end continuously).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading

log = logging.getLogger("hf_paged")

ATTENTION_NAME = "hf_paged"
FALLBACK = "_hf_paged_replaced_attention"    # module attribute while switched: the implementation replaced
SWITCH_ATTR = "_hf_paged_attention_switch"    # the model's switch while one is open
CLOSE_WAIT_S = 300.0                         # how long the last block out waits for other threads' forwards


class _AttentionSwitch:
    """One model's switch: ``users`` blocks open, ``forwards`` decoder forwards begun while switched and not
    ended, the implementation to restore (``previous``). Its condition guards all of them."""

    def __init__(self):
        self.condition = threading.Condition()
        self.users = 0
        self.forwards = 0
        self.previous: str | None = None
        self.decoder = self.own_forward = None     # the decoder whose forward is counted, and its forward before
        self.counting = None                       # the counting forward set on it
        self.is_open = False
        self.begun = threading.local()       # .depth: this thread's forwards counted in ``forwards``

    def open(self, model) -> None:
        self.previous, self.is_open = model.config._attn_implementation, True
        if self.previous == ATTENTION_NAME:          # the user's own choice: nothing to switch or restore
            return
        for module in model.modules():               # plain attributes: no parameter, buffer or config
            module.__dict__[FALLBACK] = self.previous
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        own = decoder.__dict__.get("forward")       # an instance forward of someone else's (accelerate), or None
        underneath = own if own is not None else type(decoder).forward.__get__(decoder)
        self.decoder, self.own_forward = decoder, own
        self.counting = decoder.forward = functools.partial(self._counted, underneath)
        model.set_attn_implementation(ATTENTION_NAME)

    def close(self, model) -> None:
        """Restore the model (the condition held, no user left, the counted forwards ended)."""
        if self.previous != ATTENTION_NAME:
            model.set_attn_implementation(self.previous)
            for module in model.modules():
                module.__dict__.pop(FALLBACK, None)
            if self.decoder.__dict__.get("forward") is self.counting:       # ours (nobody replaced it meanwhile)
                if self.own_forward is None:
                    del self.decoder.forward
                else:
                    self.decoder.forward = self.own_forward
        self.decoder = self.own_forward = self.counting = None
        self.is_open = False
        if model.__dict__.get(SWITCH_ATTR) is self:
            del model.__dict__[SWITCH_ATTR]

    def own_forwards(self) -> int:
        return getattr(self.begun, "depth", 0)

    def _counted(self, forward, *args, **kwargs):
        """The decoder's forward while switched, counted from its start to its end, however it ends (a
        KeyboardInterrupt too: torch's always-called forward hooks miss those, and the count leaked)."""
        self.begun.depth = self.own_forwards() + 1
        with self.condition:
            self.forwards += 1
        try:
            return forward(*args, **kwargs)
        finally:
            self.begun.depth -= 1
            with self.condition:
                self.forwards -= 1
                self.condition.notify_all()


@contextlib.contextmanager
def switched(model):
    """``model`` switched to ``ATTENTION_NAME`` (registered already) for the block; nested and concurrent blocks
    share the switch (see the module doc)."""
    while True:
        switch = model.__dict__.setdefault(SWITCH_ATTR, _AttentionSwitch())     # atomic
        with switch.condition:
            if model.__dict__.get(SWITCH_ATTR) is not switch:        # closed meanwhile: take the next one
                continue
            if not switch.is_open:
                switch.open(model)
            switch.users += 1
            break
    try:
        yield model
    finally:
        with switch.condition:
            switch.users -= 1
            if switch.users == 0:
                mine = switch.own_forwards()      # this thread's own forwards cannot end while it waits
                drained = switch.condition.wait_for(lambda: switch.users > 0 or switch.forwards <= mine,
                                                    timeout=CLOSE_WAIT_S)
                if not drained:
                    log.warning("restoring %s's attention implementation while %d forward(s) of other threads that "
                                "began during a paged call still run (waited %.0f s): they may fail",
                                type(model).__name__, switch.forwards - mine, CLOSE_WAIT_S)
                if switch.users == 0:
                    switch.close(model)
