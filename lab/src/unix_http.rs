//! One HTTP/1.1 exchange over a Unix socket, blocking: how the lab talks to
//! its emulators' admin sockets (the lab's library is not async).

use std::{
    io::{self, Read, Write},
    os::unix::net::UnixStream,
    path::Path,
    time::Duration,
};

/// Sends `method path` with `body` (JSON unless `content_type` says
/// otherwise) on a fresh connection and reads the whole answer: its status
/// and body. The server must answer with a body it ends by closing (what
/// `Connection: close` asks of it).
pub fn exchange(
    socket: &Path,
    method: &str,
    path: &str,
    content_type: &str,
    body: &[u8],
    timeout: Duration,
) -> io::Result<(u16, Vec<u8>)> {
    let mut stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply)?;
    let (status, body) = split_response(&reply).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not an HTTP response: {}", String::from_utf8_lossy(&reply)),
        )
    })?;
    Ok((status, body))
}

/// The status and body of a `Connection: close` response, with its body
/// either sized (`Content-Length`) or chunked.
fn split_response(reply: &[u8]) -> Option<(u16, Vec<u8>)> {
    let end = reply.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&reply[..end]).ok()?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let body = &reply[end + 4..];
    let chunked = head.lines().any(|line| {
        line.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    if !chunked {
        return Some((status, body.to_vec()));
    }
    let mut out = Vec::new();
    let mut rest = body;
    loop {
        let line_end = rest.windows(2).position(|w| w == b"\r\n")?;
        let size =
            usize::from_str_radix(std::str::from_utf8(&rest[..line_end]).ok()?.trim(), 16).ok()?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Some((status, out));
        }
        out.extend_from_slice(rest.get(..size)?);
        rest = rest.get(size + 2..)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_sized_and_chunked_responses() {
        let sized = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(split_response(sized), Some((200, b"{}".to_vec())));
        let chunked = b"HTTP/1.1 404 Not Found\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(split_response(chunked), Some((404, b"abcde".to_vec())));
        assert_eq!(split_response(b"garbage"), None);
    }
}
