"""The campaign's hostile tenant (tests/node/campaign.py): the namespace `hostile`, whose
subscription `mixed` sends to a receiver that answers at random (2xx late or early, 4xx,
5xx, a hang, a reset connection, a trickled answer) and whose subscription `gone`
answers 410 Gone. The nemesis changes the namespace's in-flight quota and rotates `mixed`'s
signing secret while the campaign runs; this module records what was in force when, and
what arrived, so that the checker can hold herald to:

- the in-flight quota: attempts of the namespace on the wire at once (counted by the
  receiver, from a request's arrival until its answer is sent or herald drops the
  connection) never above the replicas times the largest quota in force over the last
  QUOTA_LAG (README: each replica applies the limit to the shards it holds);
- secret rotation: every attempt signed with a secret the tenant named; none signed with a
  rotated-out secret more than ROTATION_GRACE after the tenant dropped it; every attempt
  signed with the newest secret once ROTATION_GRACE has passed since the tenant named it;
- 410 Gone: `gone` is disabled with reason Gone, and sees at most a handful of attempts.
"""

import base64
import bisect
import collections
import json
import random
import select
import socket
import struct
import threading
import time

from standardwebhooks.webhooks import Webhook

from conftest import SECRET, ControlHandler, ReceiverServer, tenant

HOSTILE = "hostile"
MIXED_TIMEOUT = 2.0
# herald learns of a quota change or a rotation from its watch, which a paused API server,
# a paused replica or a partition from the API server (up to 12 s) delays; an attempt that
# started just before lasts up to MIXED_TIMEOUT more.
ROTATION_GRACE = 20.0
QUOTA_LAG = ROTATION_GRACE + MIXED_TIMEOUT
QUOTAS = [16, 24, 32]
# How late the receiver may see a connection herald closed: its thread wakes from select on
# a loaded 2-core machine, behind the GIL and thirty-odd other handler threads.
CLOSE_SEEN_WITHIN = 0.5
# (answer, weight): what the receiver does with a request to `mixed`. No 429 (or 502, 504):
# each halves the lane's pace for 30 s, as the README says, so a steady share of them holds
# the lane at a start a second by design and the campaign's events would not drain.
ANSWERS = [("ok", 45), ("ok-late", 14), ("500", 10), ("503", 5), ("400", 4),
           ("hang", 8), ("reset", 6), ("trickle", 8)]
# Answers that end an event's deliveries (accepted, or dead-lettered at once).
FINAL = {"ok", "ok-late", "400"}


def new_secret(rng):
    return "whsec_" + base64.b64encode(rng.randbytes(24)).decode()


class HostileReceiver:
    """Answers `mixed`'s requests as ANSWERS says (seeded), `gone`'s with 410. Records each
    arrival (event id, path, arrival time, answer, the secrets that verify it) and the
    requests on the wire at once. Also serves GET /control for the producer."""

    def __init__(self, host, rng):
        self.rng = rng
        self.lock = threading.Lock()
        self.secrets = [Webhook(SECRET)]   # index -> verifier; rotations append
        self.deliveries = []   # (event id, verified by (indexes), arrival, path, answer)
        self.bad = []
        self.overlaps = []
        self.in_flight_by_id = {}
        self.on_wire = 0
        self.peaks = []        # (time, requests on the wire) whenever it reached QUOTAS[0]
        self.most = 0
        self.closes = []       # when the receiver saw herald close a connection it had not answered
        self.control = "go"
        receiver = self

        class Handler(ControlHandler):
            def gone(self, seconds):
                """Waits up to `seconds`; True as soon as herald has closed the connection."""
                deadline = time.monotonic() + seconds
                while (left := deadline - time.monotonic()) > 0:
                    readable, _, _ = select.select([self.connection], [], [], left)
                    if readable:
                        try:
                            if self.connection.recv(1, socket.MSG_PEEK) == b"":
                                return True
                        except OSError:
                            return True
                        # Bytes of a next request: herald does not pipeline, so none come.
                        time.sleep(min(left, 0.05))
                return False

            def off_wire(self, closed=False):
                """The request no longer counts as on the wire: counted from after its body
                was read until before its answer is written (inside herald's own span of
                the attempt), or until herald was seen to close the connection (`closed`:
                seen a moment late, which the checker allows for)."""
                if self.counted:
                    self.counted = False
                    with receiver.lock:
                        receiver.on_wire -= 1
                        if closed:
                            receiver.closes.append(time.monotonic())

            def answer(self, status, extra=()):
                self.off_wire()
                self.send_response(status)
                for k, v in extra:
                    self.send_header(k, v)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                event_id = headers.get("webhook-id", "")
                with receiver.lock:
                    verifiers = list(enumerate(receiver.secrets))
                    kind = "410" if self.path == "/hooks/gone" else receiver.choose()
                    if receiver.in_flight_by_id.get(event_id):
                        receiver.overlaps.append(event_id)
                    receiver.in_flight_by_id[event_id] = receiver.in_flight_by_id.get(event_id, 0) + 1
                    receiver.on_wire += 1
                    self.counted = True
                    receiver.most = max(receiver.most, receiver.on_wire)
                    if receiver.on_wire >= QUOTAS[0]:
                        receiver.peaks.append((time.monotonic(), receiver.on_wire))
                verified = []
                for index, verifier in verifiers:
                    try:
                        verifier.verify(body, headers)
                        verified.append(index)
                    except Exception:  # the verifier's own WebhookVerificationError
                        pass
                with receiver.lock:
                    receiver.deliveries.append((event_id, tuple(verified), time.monotonic(), self.path, kind))
                    if not verified:
                        receiver.bad.append((event_id, self.path, "no secret the tenant named verifies it"))
                try:
                    self.act(kind)
                except OSError:
                    self.off_wire(closed=True)  # herald gave up on the attempt first
                finally:
                    self.off_wire(closed=True)
                    with receiver.lock:
                        receiver.in_flight_by_id[event_id] -= 1

            def act(self, kind):
                if kind == "ok":
                    self.answer(204)
                elif kind == "ok-late":
                    if not self.gone(receiver.rng_uniform(0.3, MIXED_TIMEOUT * 0.6)):
                        self.answer(200)
                elif kind in ("500", "503", "400", "410"):
                    self.answer(int(kind))
                elif kind == "hang":
                    self.gone(MIXED_TIMEOUT * 5)
                    self.close_connection = True
                elif kind == "reset":
                    # SO_LINGER 0: closing sends RST rather than FIN.
                    self.off_wire()
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                elif kind == "trickle":
                    # A 200 whose body comes a byte at a time, slower than herald's timeout:
                    # on the wire until herald drops it (or reads it all, 6 s later).
                    self.send_response(200)
                    self.send_header("Content-Length", "20")
                    self.end_headers()
                    self.wfile.flush()
                    for i in range(20):
                        if self.gone(0.3):
                            break
                        if i == 19:
                            self.off_wire()
                        self.wfile.write(b".")
                        self.wfile.flush()
                    self.close_connection = True

        Handler.receiver = self
        self.server = ReceiverServer((host, 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def choose(self):
        """An answer for `mixed` (the caller holds the lock)."""
        return self.rng.choices([a for a, _ in ANSWERS], weights=[w for _, w in ANSWERS])[0]

    def rng_uniform(self, low, high):
        with self.lock:
            return self.rng.uniform(low, high)

    def add_secret(self, secret):
        with self.lock:
            self.secrets.append(Webhook(secret))
            return len(self.secrets) - 1

    def ids(self, prefix=""):
        """Ids that reached `mixed` at least once, verified (whatever the answer)."""
        with self.lock:
            return [d[0] for d in self.deliveries
                    if d[1] and d[0].startswith(prefix) and d[3] == "/hooks/mixed"]

    def arrivals_at(self, path):
        with self.lock:
            return [d for d in self.deliveries if d[3] == path]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Hostile:
    """The namespace `hostile`: its two subscriptions, its WebhookQuota, and what the nemesis
    changes in them (the quota, `mixed`'s secret), with when."""

    def __init__(self, cluster, rng):
        self.cluster = cluster
        self.rng = rng
        self.receiver = HostileReceiver(cluster.node_ip, random.Random(rng.random()))
        self.quotas = []       # (time the API server had it, maxInFlight)
        # index -> [secret, time named, time dropped or None]
        self.rotations = [[SECRET, 0.0, None]]
        self.primary = 0
        # Moments the wire held more than the bound, all but connections seen closed late.
        self.excused = 0

    def set_up(self):
        for name in ("mixed", "gone"):
            tenant(self.cluster, HOSTILE, self.receiver.port, name=name, path=f"/hooks/{name}")
        # Answers slower than the others' and no auto-disable: `mixed` fails often on purpose.
        self.cluster.kubectl("patch", "whsub", "mixed", "-n", HOSTILE, "--type=merge", "-p",
                             '{"spec":{"disableAfterConsecutiveFailures":0,"delivery":{"timeout":"2s",'
                             '"maxInFlight":64,"retry":{"maxAttempts":30,"initialBackoff":"100ms",'
                             '"maxBackoff":"1s"}}}}')
        self.set_quota(QUOTAS[0])

    def set_quota(self, value):
        self.cluster.apply({"apiVersion": "herald.dev/v1alpha1", "kind": "WebhookQuota",
                            "metadata": {"name": "quota", "namespace": HOSTILE},
                            "spec": {"maxInFlight": value}})
        self.quotas.append((time.monotonic(), value))

    def change_quota(self):
        value = self.rng.choice([q for q in QUOTAS if q != self.quotas[-1][1]])
        self.set_quota(value)
        return value

    def rotate(self, overlap):
        """The tenant's rotation: a new Secret, named as `mixed`'s secret with the old one
        still signing beside it; after `overlap` seconds, the old one dropped (and its
        Secret deleted)."""
        secret = new_secret(self.rng)
        index = self.receiver.add_secret(secret)
        old = self.primary
        name = f"mixed-secret-{index}"
        self.cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": HOSTILE},
                            "type": "Opaque", "stringData": {"secret": secret}})
        old_name = "mixed-secret" if old == 0 else f"mixed-secret-{old}"
        self.patch_signing(name, [old_name])
        self.rotations.append([secret, time.monotonic(), None])
        self.primary = index
        time.sleep(overlap)
        self.patch_signing(name, [])
        self.rotations[old][2] = time.monotonic()
        self.cluster.kubectl("delete", "secret", old_name, "-n", HOSTILE, "--wait=false", check=False)

    def patch_signing(self, name, additional):
        signing = {"secretRef": {"name": name, "key": "secret"},
                   "additionalSecretRefs": [{"name": n, "key": "secret"} for n in additional]}
        self.cluster.kubectl("patch", "whsub", "mixed", "-n", HOSTILE, "--type=merge",
                             "-p", json.dumps({"spec": {"signing": signing}}), timeout=60)

    # The checks, once the campaign is over.

    def quota_violations(self, replicas):
        """(time, requests on the wire, bound) wherever the wire held more than the bound. A
        connection herald closed is seen closed a moment late (CLOSE_SEEN_WITHIN): as many
        as were seen closed that shortly after are not held against herald."""
        out = []
        closes = sorted(self.receiver.closes)
        for at, count in self.receiver.peaks:
            in_force = [v for t, v in self.quotas if at - QUOTA_LAG <= t <= at]
            before = [v for t, v in self.quotas if t < at - QUOTA_LAG]
            bound = replicas * max(in_force + before[-1:])
            late = bisect.bisect_right(closes, at + CLOSE_SEEN_WITHIN) - bisect.bisect_left(closes, at)
            if count > bound + late:
                out.append((round(at, 2), count, bound))
            elif count > bound:
                self.excused += 1
        return out

    def rotation_violations(self):
        """Attempts to `mixed` signed with a secret dropped more than ROTATION_GRACE before,
        or, ROTATION_GRACE after a secret was named, not signed with it (or a newer one)."""
        out = []
        for event_id, verified, at, path, _ in self.receiver.arrivals_at("/hooks/mixed"):
            for index, (_, named, dropped) in enumerate(self.rotations):
                if dropped is not None and at > dropped + ROTATION_GRACE and index in verified:
                    out.append((event_id, f"signed with secret {index}, dropped {at - dropped:.1f}s before"))
            settled = [i for i, (_, named, _) in enumerate(self.rotations) if named <= at - ROTATION_GRACE]
            if settled and not any(i >= settled[-1] for i in verified):
                out.append((event_id, f"not signed with secret {settled[-1]}, named "
                                      f"{at - self.rotations[settled[-1]][1]:.1f}s before"))
        return out

    def answered(self):
        """Answers given to `mixed`, by kind."""
        return collections.Counter(d[4] for d in self.receiver.arrivals_at("/hooks/mixed"))

