"""herald's signatures against the reference verifiers of each scheme, both ways.

herald signs -> the `standardwebhooks` / `stripe` packages (and, for ed25519, the
`cryptography` package) verify; those packages sign -> `herald verify` accepts, and refuses
tampering.
HERALD_BIN names the herald binary (the test command builds it).
"""

import base64
import json
import os
import random
import subprocess
import time
from datetime import datetime, timezone

import pytest
import stripe
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

HERALD = os.environ.get("HERALD_BIN", "target/debug/herald")

SW_SECRET = "whsec_" + base64.b64encode(bytes(range(24))).decode()
SW_SECRET_NEXT = "whsec_" + base64.b64encode(bytes(range(100, 132))).decode()
STRIPE_SECRET = "whsec_stripe_compatible_test_secret"
STRIPE_SECRET_NEXT = "whsec_rotated_in_secret"


def bodies():
    rng = random.Random(215)
    yield '{"type":"invoice.paid","data":{"amount":1200}}'
    yield json.dumps({"type": "unicode", "data": {"text": "Grüße, 東京, emoji 🚀, quote \" and \\ slash"}})
    yield json.dumps({"type": "big", "data": ["x" * 1000] * 200})
    for _ in range(5):
        yield json.dumps({"type": "random", "n": rng.random(), "s": "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(0, 300)))})


BODIES = list(bodies())


def herald(*args, body: str):
    return subprocess.run(
        [HERALD, *args, "--body-file", "-"],
        input=body.encode(),
        capture_output=True,
        timeout=30,
    )


def herald_sign(scheme, secrets, body, msg_id="evt_interop_1", timestamp=None):
    timestamp = int(time.time()) if timestamp is None else timestamp
    args = ["sign", "--scheme", scheme, "--id", msg_id, "--timestamp", str(timestamp)]
    for secret in secrets:
        args += ["--secret", secret]
    result = herald(*args, body=body)
    assert result.returncode == 0, result.stderr.decode()
    headers = {}
    for line in result.stdout.decode().splitlines():
        name, value = line.split(": ", 1)
        headers[name] = value
    return headers


def herald_verify(scheme, secrets, headers, body, now=None):
    args = ["verify", "--scheme", scheme]
    for secret in secrets:
        args += ["--secret", secret]
    for name, value in headers.items():
        args += ["--header", f"{name}: {value}"]
    if now is not None:
        args += ["--now", str(now)]
    return herald(*args, body=body)


# --- Standard Webhooks -------------------------------------------------------------------


@pytest.mark.parametrize("body", BODIES)
def test_standardwebhooks_package_verifies_herald_signatures(body):
    headers = herald_sign("standard-webhooks", [SW_SECRET], body)
    assert set(headers) == {"webhook-id", "webhook-timestamp", "webhook-signature"}
    Webhook(SW_SECRET).verify(body, headers, json_parse=False)


def test_standardwebhooks_package_rejects_tampered_herald_signatures():
    body = BODIES[0]
    headers = herald_sign("standard-webhooks", [SW_SECRET], body)
    with pytest.raises(WebhookVerificationError):
        Webhook(SW_SECRET).verify(body.replace("1200", "1201"), headers, json_parse=False)
    with pytest.raises(WebhookVerificationError):
        Webhook(SW_SECRET_NEXT).verify(body, headers, json_parse=False)


def test_rotation_each_secret_verifies_with_the_standardwebhooks_package():
    body = BODIES[1]
    headers = herald_sign("standard-webhooks", [SW_SECRET_NEXT, SW_SECRET], body)
    assert len(headers["webhook-signature"].split(" ")) == 2
    Webhook(SW_SECRET).verify(body, headers, json_parse=False)
    Webhook(SW_SECRET_NEXT).verify(body, headers, json_parse=False)


@pytest.mark.parametrize("body", BODIES)
def test_herald_verifies_standardwebhooks_package_signatures(body):
    now = datetime.now(tz=timezone.utc)
    signature = Webhook(SW_SECRET).sign("msg_from_python", now, body)
    headers = {
        "webhook-id": "msg_from_python",
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signature,
    }
    result = herald_verify("standard-webhooks", [SW_SECRET], headers, body)
    assert result.returncode == 0, result.stderr.decode()

    tampered = herald_verify("standard-webhooks", [SW_SECRET], headers, body + " ")
    assert tampered.returncode == 1
    assert b"no signature matches" in tampered.stderr


def test_herald_refuses_a_standardwebhooks_signature_outside_tolerance():
    body = BODIES[0]
    then = datetime.fromtimestamp(1_700_000_000, tz=timezone.utc)
    headers = {
        "webhook-id": "msg_old",
        "webhook-timestamp": "1700000000",
        "webhook-signature": Webhook(SW_SECRET).sign("msg_old", then, body),
    }
    ok = herald_verify("standard-webhooks", [SW_SECRET], headers, body, now=1_700_000_000 + 300)
    assert ok.returncode == 0, ok.stderr.decode()
    late = herald_verify("standard-webhooks", [SW_SECRET], headers, body, now=1_700_000_000 + 301)
    assert late.returncode == 1
    assert b"older than now" in late.stderr


# --- Standard Webhooks v1a (ed25519) ----------------------------------------------------
# Neither the `standardwebhooks` package on PyPI (1.3.0, its newest there) nor `svix` nor the
# npm package implements v1a, so herald's ed25519 signatures are checked against the
# `cryptography` package's Ed25519 directly, over the scheme's signed content
# "{id}.{timestamp}.{body}".

ED_SEED = bytes(range(40, 72))
ED_SECRET = "whsk_" + base64.b64encode(ED_SEED).decode()


def ed_public_bytes(seed):
    return Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )


ED_PUBLIC = "whpk_" + base64.b64encode(ed_public_bytes(ED_SEED)).decode()


def v1a_signatures(header):
    return [base64.b64decode(e.split(",", 1)[1]) for e in header.split(" ") if e.startswith("v1a,")]


def test_herald_public_key_is_the_one_cryptography_derives():
    result = subprocess.run(
        [HERALD, "public-key", "--secret", ED_SECRET], capture_output=True, timeout=30
    )
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().strip() == ED_PUBLIC


@pytest.mark.parametrize("body", BODIES)
def test_cryptography_verifies_herald_v1a_signatures(body):
    headers = herald_sign("standard-webhooks", [ED_SECRET], body)
    (signature,) = v1a_signatures(headers["webhook-signature"])
    public = Ed25519PublicKey.from_public_bytes(ed_public_bytes(ED_SEED))
    content = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body.encode()
    public.verify(signature, content)
    with pytest.raises(InvalidSignature):
        public.verify(signature, content + b" ")


@pytest.mark.parametrize("body", BODIES)
def test_herald_verifies_cryptography_v1a_signatures_with_the_public_key(body):
    msg_id, timestamp = "msg_v1a_interop", int(time.time())
    content = f"{msg_id}.{timestamp}.".encode() + body.encode()
    signature = Ed25519PrivateKey.from_private_bytes(ED_SEED).sign(content)
    headers = {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": "v1a," + base64.b64encode(signature).decode(),
    }
    result = herald_verify("standard-webhooks", [ED_PUBLIC], headers, body)
    assert result.returncode == 0, result.stderr.decode()
    tampered = herald_verify("standard-webhooks", [ED_PUBLIC], headers, body + " ")
    assert tampered.returncode == 1
    other = "whpk_" + base64.b64encode(ed_public_bytes(bytes(32))).decode()
    wrong = herald_verify("standard-webhooks", [other], headers, body)
    assert wrong.returncode == 1
    assert b"no signature matches" in wrong.stderr


# --- Stripe-compatible -----------------------------------------------------------------


@pytest.mark.parametrize("body", BODIES)
def test_stripe_package_verifies_herald_signatures(body):
    headers = herald_sign("stripe", [STRIPE_SECRET], body)
    assert list(headers) == ["Herald-Signature"]
    assert stripe.WebhookSignature.verify_header(body, headers["Herald-Signature"], STRIPE_SECRET, tolerance=300)


def test_stripe_package_rejects_tampered_herald_signatures():
    body = BODIES[0]
    header = herald_sign("stripe", [STRIPE_SECRET], body)["Herald-Signature"]
    with pytest.raises(stripe.SignatureVerificationError):
        stripe.WebhookSignature.verify_header(body + "x", header, STRIPE_SECRET, tolerance=300)
    with pytest.raises(stripe.SignatureVerificationError):
        stripe.WebhookSignature.verify_header(body, header, STRIPE_SECRET_NEXT, tolerance=300)


def test_rotation_each_secret_verifies_with_the_stripe_package():
    body = BODIES[2]
    header = herald_sign("stripe", [STRIPE_SECRET_NEXT, STRIPE_SECRET], body)["Herald-Signature"]
    assert header.count("v1=") == 2
    for secret in (STRIPE_SECRET, STRIPE_SECRET_NEXT):
        assert stripe.WebhookSignature.verify_header(body, header, secret, tolerance=300)


@pytest.mark.parametrize("body", BODIES)
def test_herald_verifies_stripe_package_signatures(body):
    header = stripe.WebhookSignature.generate_signature_header(body, STRIPE_SECRET)
    result = herald_verify("stripe", [STRIPE_SECRET], {"Herald-Signature": header}, body)
    assert result.returncode == 0, result.stderr.decode()

    wrong = herald_verify("stripe", [STRIPE_SECRET_NEXT], {"Herald-Signature": header}, body)
    assert wrong.returncode == 1
    assert b"no signature matches" in wrong.stderr


def test_herald_verify_reports_malformed_headers_without_crashing():
    body = BODIES[0]
    for value in ["", "t=abc,v1=00", "v1=00", "t=1,v1=zz", "garbage"]:
        result = herald_verify("stripe", [STRIPE_SECRET], {"Herald-Signature": value}, body)
        assert result.returncode == 1, value
        assert result.stderr.startswith(b"invalid: "), result.stderr
