"""The pipeline's weights: the policy the learner published last, and the version each generator
holds. No global sync: each generator loads the newest published policy on its own, between its
batches, and (``checks.verify_sync``) proves it holds it (``rayppo/trainers/pipeline.py``)."""

from __future__ import annotations

import threading
from collections import defaultdict

from rayppo.actors.generator import GeneratorEngine
from rayppo.cluster.group import get, get_within
from rayppo.learner.guard import check_weights
from rayppo.trainers.distributed_roles import DistributedRoles
from rayppo.trainers.pipeline_stages import Published


class GeneratorWeights:
    """What the learner published (``published``) and what each generator holds (``held``)."""

    def __init__(self, calls: DistributedRoles, verify: bool, cond: threading.Condition) -> None:
        self.calls, self.verify, self._cond = calls, verify, cond
        self.published = Published(0)
        """The newest policy; the stage threads wait on ``cond`` for a newer one."""
        # Per generator (the fleet may grow): the version it holds (it built the initial weights).
        self.held: defaultdict[int, int] = defaultdict(int)
        self._unverified = False  # some generator could not be fingerprinted
        self._payload_nbytes: int | None = None

    def publish(self, version: int) -> None:
        """Rank 0's weights of ``version`` into the object store; waiting generators may go on."""
        learner = self.calls.learner
        payload = learner.policy_weights()
        prints = learner.sent_fingerprints() if self.verify else None
        if self._payload_nbytes is None:  # the size never changes: read the payload once
            self._payload_nbytes = get(payload).nbytes
        with self._cond:
            self.published = Published(version, payload, prints)
            self._cond.notify_all()

    def built(self, i: int) -> None:
        """Generator ``i`` is a new engine: it holds the initial weights it built."""
        self.held[i] = 0

    def forget_held(self) -> None:
        """After a restore: every generator loads the published weights before its next batch."""
        self.held = defaultdict(lambda: -1)

    def catch_up(self, g: int, published: Published | None = None) -> None:
        """Generator ``g`` loads ``published`` (default: the newest) unless it holds it already."""
        published = published or self.published
        if published.version > self.held[g]:
            self.load(g, published)

    def load(self, g: int, published: Published) -> None:
        """Generator g takes the published weights, then (``checks.verify_sync``) proves it holds them."""
        # A generator replaced during these calls takes *these* weights (the ones it is checked
        # against below), not newer ones published meanwhile.
        def refresh(i: int) -> None:
            self.refresh(i, published)

        version = self.calls.on_generator(g, GeneratorEngine.load_weights, (published.payload,), refresh)
        if version != published.version:
            raise RuntimeError(f"generator {g} reports policy version {version} after loading {published.version}")
        if published.fingerprints is not None:
            # A generator replaced during this call takes the published weights first (``refresh``):
            # a fresh engine has loaded nothing, so it would fingerprint nothing.
            held = self.calls.on_generator(g, GeneratorEngine.weight_fingerprints, (), refresh)
            if held is None:  # tensor-parallel vLLM cannot be fingerprinted yet: sync/verified = NaN
                self._unverified = True
            else:
                check_weights(published.fingerprints, held, g, version)
        self.held[g] = version

    def refresh(self, i: int, published: Published | None = None) -> None:
        """A replacement generator i takes ``published`` (default: the newest) weights, within the
        call deadline; its own build is version 0."""
        published = published or self.published
        self.held[i] = 0
        if published.payload is not None:
            future = self.calls.generators.call_at(i, GeneratorEngine.load_weights, (published.payload,))
            self.held[i] = get_within(future, self.calls.supervisor.timeout_s,
                                      f"replacement generator {i} could not load policy version {published.version}")

    def verified(self) -> float:
        """``sync/verified``: 1.0 when every generator's loads were checked (a failed check stops
        the run), NaN when some generator cannot be fingerprinted, 0.0 with the check off."""
        if not self.verify:
            return 0.0
        return float("nan") if self._unverified else 1.0

    def payload_bytes(self, generators: int) -> int:
        """Bytes of one copy of the weights times ``generators`` (as ``sync/bytes`` counts them)."""
        return (self._payload_nbytes or 0) * generators
