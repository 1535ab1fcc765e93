"""Who a peer request is for, and who sent it: the signature's receiver and sender port, this
agent's own names, a host name bound to the identity that proved it, conflicts said."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from agent.fleet.jobstate import JobIncident
from agent.fleet.jobverdict import judge_job
from agent.fleet.messages import Evidence
from agent.fleet.peers import OwnNames
from agent.fleet.proof import (
    MAX_SKEW_S,
    NONCE_LOG_SLACK,
    NonceCache,
    RequestSignature,
    authority_host,
    sign_request,
)

TOKEN = b"t" * 32


def test_a_signature_binds_the_receiver_and_the_senders_port() -> None:
    header = sign_request(TOKEN, "POST", "10.0.0.2:7207", "/v1/incidents", b"{}", sender_port=7207)
    sig = RequestSignature.parse(header)
    assert sig is not None and sig.port == 7207
    assert sig.valid(TOKEN, "POST", "10.0.0.2:7207", "/v1/incidents")
    assert not sig.valid(TOKEN, "POST", "10.0.0.9:7207", "/v1/incidents")  # another receiver
    forged = RequestSignature.parse(header.replace("port=7207", "port=7208"))
    assert forged is not None and not forged.valid(TOKEN, "POST", "10.0.0.2:7207", "/v1/incidents")
    v1 = RequestSignature.parse(sign_request(TOKEN, "POST", "10.0.0.2:7207", "/p", b""))
    assert v1 is not None and v1.port is None and v1.valid(TOKEN, "POST", "10.0.0.2:7207", "/p")
    assert RequestSignature.parse(header.replace("port=7207", "port=0")) is None


def test_authority_hosts() -> None:
    assert authority_host("10.0.0.2:7207") == ("10.0.0.2", "7207")
    assert authority_host("[fd00::2]:7207") == ("fd00::2", "7207")
    assert authority_host("Node-B.example:7207") == ("node-b.example", "7207")
    assert authority_host("node-b") == ("node-b", "")
    assert authority_host("fd00::2") == ("fd00::2", "")


def test_own_names_of_a_bound_and_a_wildcard_agent() -> None:
    bound = OwnNames("127.0.0.52", ["node-b"])
    assert bound("127.0.0.52") and bound("NODE-B") and not bound("127.0.0.53") and not bound("127.0.0.1")
    wildcard = OwnNames("0.0.0.0", ["node-b"])
    assert wildcard("127.0.0.1") and wildcard("localhost") and not wildcard("192.0.2.77")
    wildcard.add("node-b.svc.cluster.local")
    assert wildcard("node-b.svc.cluster.local")


def test_a_host_name_belongs_to_the_identity_that_proved_it_first() -> None:
    job = JobIncident()
    assert job.prove("node-x", "10.0.0.3:7207") == ""
    assert job.prove("node-x", "10.0.0.3:7207") == ""
    line = job.prove("node-x", "10.0.0.9:7207", "evidence")
    assert line == "evidence for host node-x from 10.0.0.9:7207 refused: node-x is proven at 10.0.0.3:7207"
    assert job.prove("node-y", "10.0.0.3:7207", "a report").endswith("refused: 10.0.0.3:7207 is node-x")
    assert job.summary()["conflicts"] == 2 and job.conflicts[0] == line


def test_a_rank_two_hosts_claim_is_a_conflict_in_the_verdict() -> None:
    trace = "a" * 32

    def ev(host: str, rank: int) -> Evidence:
        return Evidence.model_validate({"job": "j", "host.name": host, "trace_id": trace, "incident_id": f"i-{host}",
                                        "ranks": [{"rank": rank, "frame_class": "collective"}]})

    verdict = judge_job([ev("node-a", 0), ev("node-b", 0)], conflicts=["evidence for host node-x from 10.0.0.9:7207 refused"])
    assert verdict.conflicts == ("evidence for host node-x from 10.0.0.9:7207 refused", "rank 0 claimed by node-a and node-b: node-a's kept")
    assert "2 identity conflicts: evidence for host node-x" in verdict.headline()
    assert verdict.to_json()["conflicts"] == list(verdict.conflicts)
    assert verdict.attributes()["servewatch.job.verdict.conflicts"] == verdict.conflicts


def test_the_asked_members_answer_proves_its_host_over_an_earlier_claim() -> None:
    trace = "a" * 32
    job = JobIncident()
    # a token holder at 10.0.0.9 claimed node-x first: its report and evidence were taken
    assert job.prove("node-x", "10.0.0.9:7207", "a report") == ""
    job.reported["http://10.0.0.9:7207"], job.reported_by["http://10.0.0.9:7207"] = "node-x", "10.0.0.9:7207"
    job.add_evidence(Evidence.model_validate({"job": "j", "host.name": "node-x", "trace_id": trace, "incident_id": "forged"}),
                     "10.0.0.9:7207")
    # node-x's own verified join answer, at the address the coordinator asked: node-x is there
    assert job.prove("node-x", "10.0.0.3:7207", "a join's answer", asked=True) == ""
    assert job.proven["node-x"] == "10.0.0.3:7207" and "node-x" not in job.evidence and not job.reported
    assert job.conflicts == [("node-x was claimed by 10.0.0.9:7207, refused: a join's answer from 10.0.0.3:7207"
                             " (the member asked there) proves node-x at 10.0.0.3:7207")]
    # the earlier claimant speaks for no host any more; a second asked answer for node-x is a conflict
    assert job.prove("node-x", "10.0.0.9:7207", "evidence").endswith("node-x is proven at 10.0.0.3:7207")
    assert job.prove("node-y", "10.0.0.9:7207", "evidence").endswith("10.0.0.9:7207 is node-x")
    assert job.prove("node-x", "10.0.0.4:7207", "a join's answer", asked=True).endswith("node-x is proven at 10.0.0.3:7207")
    # this agent's own name is never taken
    job.prove("node-a", "this agent")
    assert job.prove("node-a", "10.0.0.5:7207", "a join's answer", asked=True).endswith("node-a is proven at this agent (every agent of a job needs its own host name: SERVEWATCH_HOST_NAME)")


def test_the_nonce_cache_persists_fresh_nonces_only(tmp_path: Path) -> None:
    path = str(tmp_path / "nonces")
    now = time.time()
    cache = NonceCache.load(path, now_s=now)
    assert cache.first_use("a" * 32, now_s=now, ts=now) and not cache.first_use("a" * 32, now_s=now, ts=now)
    assert cache.first_use("b" * 32, now_s=now, ts=now - MAX_SKEW_S)
    cache.persist("a" * 32)
    cache.persist("b" * 32)
    cache.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = NonceCache.load(path, now_s=now + 1)
    assert not again.first_use("a" * 32, now_s=now + 1, ts=now) and not again.first_use("b" * 32, now_s=now + 1, ts=now)
    again.close()
    # once their signatures are stale everywhere they are forgotten, and the file is rewritten without them
    later = NonceCache.load(path, now_s=now + 2 * MAX_SKEW_S + 5)
    later.close()
    assert Path(path).read_text() == ""
    # a long file is rewritten with the live nonces only
    cache = NonceCache.load(path, now_s=now)
    total = 2 * NONCE_LOG_SLACK + 10
    for i in range(total):
        nonce, at = f"{i:032x}", now if i < total // 2 else now + 3 * MAX_SKEW_S  # the first half stale by then
        assert cache.first_use(nonce, now_s=at, ts=at)
        cache.persist(nonce)
    cache.close()
    assert len(Path(path).read_text().splitlines()) < total
