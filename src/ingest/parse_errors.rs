//! JSON bodies for the answers hyper writes by itself.
//!
//! When a request cannot be parsed (a malformed request line or header, a URI or header
//! section over the limits) hyper answers 400, 414 or 431 with an empty body before any of
//! herald's handlers runs, and offers no hook to change that answer. Every error the API
//! returns has the documented JSON shape, so the connection's write side recognises exactly
//! those answers (one of the three statuses with `content-length: 0`; herald's own errors
//! always carry a body) and writes the same status with a JSON body instead.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Wraps a connection's I/O, rewriting hyper's own empty parse-error answers as JSON.
pub struct JsonParseErrors<T> {
    inner: T,
    /// A rewritten answer being written, how far it got, and the length of hyper's original
    /// (reported as written once the rewrite is out, since hyper tracks its own buffer).
    rewrite: Option<(Vec<u8>, usize, usize)>,
}

impl<T> JsonParseErrors<T> {
    pub fn new(inner: T) -> Self {
        Self {
            inner,
            rewrite: None,
        }
    }
}

/// The JSON answer for hyper's own empty answer `head`, if `head` is one.
fn rewritten(head: &[u8]) -> Option<Vec<u8>> {
    let (code, message) = match head.get(..13)? {
        b"HTTP/1.1 400 " => ("bad_request", "the request could not be parsed as HTTP/1.1"),
        b"HTTP/1.1 414 " => ("uri_too_long", "the request URI is too long"),
        b"HTTP/1.1 431 " => (
            "headers_too_large",
            "the request's header section is too large",
        ),
        _ => return None,
    };
    let end = head.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&head[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next()?;
    let mut empty = false;
    let mut kept = Vec::new();
    for line in lines {
        if line.eq_ignore_ascii_case("content-length: 0") {
            empty = true;
        } else {
            kept.push(line);
        }
    }
    if !empty {
        return None;
    }
    let body = serde_json::json!({"error": {"code": code, "message": message}}).to_string();
    let mut out = format!(
        "{status_line}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for line in kept {
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str("\r\n");
    out.push_str(&body);
    Some(out.into_bytes())
}

impl<T: AsyncRead + Unpin> AsyncRead for JsonParseErrors<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for JsonParseErrors<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.rewrite.is_none() {
            match rewritten(buf) {
                Some(answer) => this.rewrite = Some((answer, 0, buf.len())),
                None => return Pin::new(&mut this.inner).poll_write(cx, buf),
            }
        }
        let Some((answer, written, original)) = &mut this.rewrite else {
            unreachable!("set above");
        };
        while *written < answer.len() {
            match Pin::new(&mut this.inner).poll_write(cx, &answer[*written..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => *written += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        let original = *original;
        this.rewrite = None;
        Poll::Ready(Ok(original))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    // Not vectored: hyper then writes each answer's head as one buffer, which is what the
    // recognition above needs.
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_empty_parse_error_answers_are_rewritten() {
        let hyper_431 = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: Mon, 30 Nov 2026 17:00:00 GMT\r\n\r\n";
        let answer = String::from_utf8(rewritten(hyper_431).unwrap()).unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"));
        assert!(head.contains("content-type: application/json"));
        assert!(head.contains(&format!("content-length: {}", body.len())));
        assert!(head.contains("date: Mon, 30 Nov 2026"));
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], "headers_too_large");

        // herald's own 400s carry a body and pass untouched, as does everything else.
        let own = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 61\r\n\r\n";
        assert!(rewritten(own).is_none());
        assert!(rewritten(b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n").is_none());
        assert!(rewritten(b"{\"id\":1}").is_none());
    }
}
