"""The CloudEvents SDK (PyPI `cloudevents`) on herald's behalf, for tests/delivery_semantics.rs.

  make binary|structured ID TYPE SOURCE DATA_JSON
      prints {"headers": {...}, "body": "..."}: a CloudEvent as the SDK sends it over HTTP
  parse
      reads {"headers": {...}, "body": "<base64>"} on stdin (a request herald sent) and prints
      {"attributes": {...}, "data": ...} as the SDK reads it, or exits 1 with its error
"""

import base64
import json
import sys

from cloudevents.v1.conversion import to_binary, to_structured
from cloudevents.v1.http import CloudEvent, from_http


def main(argv):
    if argv[:1] == ["make"]:
        mode, event_id, kind, source, data = argv[1:]
        event = CloudEvent({"id": event_id, "type": kind, "source": source}, json.loads(data))
        headers, body = (to_binary if mode == "binary" else to_structured)(event)
        print(json.dumps({"headers": dict(headers), "body": body.decode()}))
    elif argv[:1] == ["parse"]:
        request = json.load(sys.stdin)
        event = from_http(request["headers"], base64.b64decode(request["body"]))
        print(json.dumps({"attributes": dict(event.get_attributes()), "data": event.get_data()}))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
