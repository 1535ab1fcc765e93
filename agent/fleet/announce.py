"""The announce: rank 0's host presents itself to every member; every member learns who coordinates.

Owns :class:`Announcer`: the loop that looks at this host's global ranks every
``announce_interval_s`` (:attr:`FleetState.local_ranks`) and, on the host of global rank 0,
announces it to every member (``POST /v1/job/announce``; again to the members that missed it every
2 s at most, and to every member every ``announce_interval_s``), recording what each member
answered (:attr:`FleetState.members`, :attr:`FleetState.announce_complete`); and the announce's
receiving side (:meth:`Announcer.on_announce`: :attr:`FleetState.announced`).

Imports anyio, :mod:`agent.fleet.fleetstate`, :mod:`agent.fleet.senders`, the fleet's peer,
fan-out and message modules and :mod:`agent.model.ranks`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio

from agent.fleet.api import Sender
from agent.fleet.fanout import bounded
from agent.fleet.fleetstate import FleetState
from agent.fleet.jobstate import Announced
from agent.fleet.messages import Announce, MemberInfo
from agent.fleet.peers import Peer, call_peer
from agent.fleet.senders import Senders
from agent.model.events import Outcome
from agent.model.ranks import distinct_env_ranks, world_ranks

__all__ = ["Announcer"]

log = logging.getLogger("servewatch.fleet")


class Announcer:
    """The announce loop (run by :meth:`agent.fleet.job.Fleet.run` for a job) and its receiving side."""

    def __init__(self, state: FleetState, senders: Senders) -> None:
        self.state = state
        self.senders = senders
        #: members (URLs) the last announce round missed: the quick rounds (every 2 s) ask only
        #: them; ``None``: the next round asks every member
        self.missed: set[str] | None = None
        #: when the next announce round asks every member again (monotonic seconds): every
        #: ``announce_interval_s`` (a member that restarted learns the coordinator again)
        self.full_at = 0.0

    async def run(self) -> None:
        """Look at this host's ranks every ``announce_interval_s``; the host of global rank 0
        announces itself to every member (again every ``announce_interval_s``), and sooner (every
        2 s at most) to the members that missed it until every one acknowledged it (at 1,000
        hosts one slow member no longer costs 999 announces every 2 s). Runs until cancelled;
        a failed round is logged, never raised."""
        state = self.state
        while True:
            try:
                ranks = await anyio.to_thread.run_sync(self.local_ranks_now)
                state.local_ranks = ranks
                if 0 in ranks:
                    await self.announce(ranks)
                else:
                    state.announce_complete, self.missed = False, None
            except Exception:  # boundary: membership is a nicety; detection and capture go on
                log.exception("announcing this agent to the job failed")
            interval = state.config.announce_interval_s
            await anyio.sleep(interval if state.announce_complete or 0 not in state.local_ranks else min(interval, 2.0))

    def local_ranks_now(self) -> tuple[int, ...]:
        """This host's global ranks: ``RANK`` in a target's environment, else its title's rank in
        this server's world (:func:`agent.model.ranks.world_ranks`). A /proc scan: a worker thread; of
        the environment only the rank variables are read (:func:`agent.host.targets.rank_environ`)."""
        from agent.host.targets import rank_environ

        targets = self.state.agent.discover()
        ranks: set[int] = set()
        by_env = distinct_env_ranks([rank_environ(t.pid) for t in targets])  # a shared RANK was inherited: none
        for target, env_rank, by_title in zip(targets, by_env, world_ranks([t.title or "" for t in targets])):
            rank = env_rank if env_rank is not None else by_title
            if rank is not None:
                ranks.add(rank)
        return tuple(sorted(ranks))

    async def announce(self, ranks: tuple[int, ...]) -> None:
        """One announce round (every member, or in a quick round those the last one missed)."""
        state = self.state
        assert state.resolver is not None
        members, _ = await state.resolver.resolve_all()
        me = await state.self_address(members)
        peers = [p for p in members if p != me and not state.resolver.is_self(p)]
        if self.missed is not None and time.monotonic() < self.full_at:
            peers = [p for p in peers if p.url in self.missed]  # a quick round: the members that missed the last
        else:
            self.full_at = time.monotonic() + state.config.announce_interval_s
        body = Announce.model_validate({"job": state.config.job, "host.name": state.host_name, "agent_id": state.agent_id,
                                        "api_port": state.port, "scheme": state.scheme, "ranks": list(ranks),
                                        "address": me.url}).model_dump(by_alias=True)

        missed: list[str] = []

        async def one(peer: Peer) -> None:
            reply = await call_peer(peer, "/v1/job/announce", body, credentials=state.credentials,
                                    timeout_s=state.config.peer_timeout_s, action="fleet.announce")
            if reply.result.outcome is Outcome.OK and reply.verified and reply.doc is not None:
                try:
                    state.members[peer.url] = MemberInfo.model_validate(reply.doc)
                except ValueError:
                    missed.append(peer.url)
            else:
                missed.append(peer.url)  # it may not know us: until every member does, the lowest host coordinates

        await bounded(peers, one, limit=state.config.fanout_concurrency)
        state.announce_complete = not missed
        self.missed = set(missed) if missed else None

    async def on_announce(self, message: Announce, sender: Sender) -> tuple[int, dict[str, Any]]:
        """``POST /v1/job/announce``: rank 0's host presented itself; the answer says who we are."""
        state = self.state
        state.announces_received += 1
        peer = await self.senders.peer_of(message, sender)
        state.announced = Announced(peer, message.host_name, tuple(message.ranks), time.monotonic())
        return 200, {"job": state.config.job, "host.name": state.host_name, "agent_id": state.agent_id,
                     "ranks": list(state.local_ranks), "world_size": state.world_size, "status": "member"}
