//! Where and how the endpoints listen: the address (`host:port` or
//! `unix:/path`), binding (retried in the background while another agent
//! still holds the port), and serving one request per connection, a
//! bounded number of connections at once, each with aws-node's timeouts.

use std::{
    convert::Infallible, fmt, net::SocketAddr, path::PathBuf, str::FromStr, sync::Arc,
    time::Duration,
};

use axum::Router;
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::{TcpListener, TcpStream, UnixListener, UnixStream},
    sync::{OwnedSemaphorePermit, Semaphore, watch},
};
use tower::ServiceExt as _;
use tracing::{debug, info, warn};

/// Connections served at once per listener; more wait in the backlog.
const MAX_CONNECTIONS: usize = 64;
/// How long a client may take to send its request's head, and a whole
/// exchange may take (aws-node: 5 s read and write timeouts).
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(30);
/// Bind retries (another agent may still hold the port while it stops).
const BIND_RETRY_FIRST: Duration = Duration::from_secs(1);
const BIND_RETRY_MAX: Duration = Duration::from_mins(1);

/// Where to listen: `host:port` (`:port` for every interface, as Go
/// writes it) or `unix:/path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListenAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl FromStr for ListenAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a socket path".into());
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        let full = if s.starts_with(':') {
            format!("0.0.0.0{s}")
        } else {
            s.to_owned()
        };
        full.parse()
            .map(Self::Tcp)
            .map_err(|_| format!("{s:?} is neither address:port nor unix:/path"))
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp(addr) => write!(f, "{addr}"),
            Self::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// A bound listener.
pub(super) enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

enum Accepted {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Listener {
    pub(super) fn bind(addr: &ListenAddr) -> std::io::Result<Self> {
        match addr {
            ListenAddr::Tcp(addr) => {
                let socket = std::net::TcpListener::bind(addr)?;
                socket.set_nonblocking(true)?;
                Ok(Self::Tcp(TcpListener::from_std(socket)?))
            }
            ListenAddr::Unix(path) => {
                // A socket file left by an earlier run is ours to replace.
                if std::fs::symlink_metadata(path)
                    .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
                {
                    std::fs::remove_file(path)?;
                }
                Ok(Self::Unix(UnixListener::bind(path)?))
            }
        }
    }

    async fn accept(&self) -> std::io::Result<Accepted> {
        match self {
            Self::Tcp(l) => l.accept().await.map(|(s, _)| Accepted::Tcp(s)),
            Self::Unix(l) => l.accept().await.map(|(s, _)| Accepted::Unix(s)),
        }
    }
}

/// Binds `addr` (unless `listener` is bound already) and serves `routes`
/// until `shutdown`; `what` names the endpoint in the logs.
pub(super) async fn serve(
    what: &'static str,
    addr: ListenAddr,
    listener: Option<Listener>,
    routes: Router,
    mut shutdown: watch::Receiver<bool>,
) {
    let listener = if let Some(listener) = listener {
        listener
    } else {
        let mut delays = crate::retry::delays(BIND_RETRY_FIRST, BIND_RETRY_MAX);
        loop {
            let delay = delays.next().unwrap_or(BIND_RETRY_MAX);
            tokio::select! {
                _ = shutdown.wait_for(|stop| *stop) => return,
                () = tokio::time::sleep(delay) => {}
            }
            match Listener::bind(&addr) {
                Ok(listener) => {
                    info!(what, address = %addr, "serving");
                    break listener;
                }
                Err(e) => debug!(what, address = %addr, error = %e, "cannot listen yet"),
            }
        }
    };
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        // Waiting for a slot before accepting leaves the rest in the backlog.
        let permit = tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => break,
            permit = Arc::clone(&slots).acquire_owned() => permit.expect("never closed"),
        };
        let accepted = tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok(Accepted::Tcp(stream)) => spawn_connection(stream, &routes, permit),
            Ok(Accepted::Unix(stream)) => spawn_connection(stream, &routes, permit),
            Err(e) => {
                // Out of descriptors, mostly: let some close.
                warn!(what, error = %e, "accepting a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    if let ListenAddr::Unix(path) = &addr {
        let _ = std::fs::remove_file(path);
    }
}

fn spawn_connection<S>(stream: S, routes: &Router, permit: OwnedSemaphorePermit)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let routes = routes.clone();
    tokio::spawn(async move {
        let _permit = permit;
        let service = service_fn(move |request: hyper::Request<Incoming>| {
            let routes = routes.clone();
            async move {
                let response = routes.oneshot(request).await;
                Ok::<_, Infallible>(response.unwrap_or_else(|never| match never {}))
            }
        });
        // One request per connection: no idle connection to time out under
        // a client about to reuse it.
        let connection = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_TIMEOUT)
            .keep_alive(false)
            .serve_connection(TokioIo::new(stream), service);
        match tokio::time::timeout(EXCHANGE_TIMEOUT, connection).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => debug!(error = %e, "introspection connection"),
            Err(_) => debug!("introspection connection timed out"),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses() {
        assert_eq!(
            "127.0.0.1:61679".parse::<ListenAddr>(),
            Ok(ListenAddr::Tcp("127.0.0.1:61679".parse().unwrap()))
        );
        assert_eq!(
            ":61678".parse::<ListenAddr>(),
            Ok(ListenAddr::Tcp("0.0.0.0:61678".parse().unwrap()))
        );
        assert_eq!(
            "unix:/run/vpcnet/introspection.sock".parse::<ListenAddr>(),
            Ok(ListenAddr::Unix("/run/vpcnet/introspection.sock".into()))
        );
        assert_eq!(
            "[::1]:61679".parse::<ListenAddr>().unwrap().to_string(),
            "[::1]:61679"
        );
        for bad in ["localhost", "61679", "unix:", "1.2.3.4"] {
            assert!(bad.parse::<ListenAddr>().is_err(), "{bad}");
        }
    }
}
