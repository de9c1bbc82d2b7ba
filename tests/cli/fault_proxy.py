"""A proxy of the tests in front of a model source (an S3 server): it flips one byte in the body
of a GET of a file whose name ends with `corrupt` (a corrupted transfer), and answers 503 to
every GET of a file named `refuse` (a server that keeps failing). Standard library only."""
import http.client
import http.server
import threading


class FaultProxy:
    def __init__(self, target_host, target_port, host="127.0.0.1", port=0, corrupt=None):
        self.corrupt, self.refuse = corrupt, None
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def forward(self):
                name = self.path.split("?")[0]
                if self.command == "GET" and proxy.refuse and name.endswith(proxy.refuse):
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(target_host, target_port, timeout=60)
                conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                r = conn.getresponse()
                data = r.read()
                if self.command == "GET" and proxy.corrupt and name.endswith(proxy.corrupt) and data:
                    data = bytearray(data)
                    data[len(data) // 2] ^= 0xFF
                    data = bytes(data)
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = forward

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
