"""An OTLP/HTTP receiver for herald's trace-context test: oteltest's HttpSink (a server from
PyPI that decodes OTLP with the official opentelemetry-proto messages), printing one JSON
line per span received, ids in hex. Usage: python otlp_sink.py PORT"""

import json
import logging
import sys
import time

from oteltest.sink import HttpSink
from oteltest.sink.handler import RequestHandler


def value(any_value):
    kind = any_value.WhichOneof("value")
    return str(getattr(any_value, kind)) if kind else None


class SpanLines(RequestHandler):
    def handle_trace(self, request, headers):
        for resource_spans in request.resource_spans:
            resource = {a.key: value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    print(json.dumps({
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "name": span.name,
                        "kind": span.kind,
                        "service": resource.get("service.name"),
                        "attributes": {a.key: value(a.value) for a in span.attributes},
                    }), flush=True)

    def handle_metrics(self, request, headers):
        pass

    def handle_logs(self, request, headers):
        pass


logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
port = int(sys.argv[1])
HttpSink(SpanLines(), logging.getLogger("otlp_sink"), port=port, daemon=True).start()
print(json.dumps({"listening": port}), flush=True)
while True:
    time.sleep(3600)
