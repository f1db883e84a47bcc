//! The operator's client of the endpoints (`vpcnet-agent pods`, `enis`,
//! `nat`): one plain HTTP/1.1 GET over TCP or a Unix socket.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::{Request, StatusCode, header::HOST};
use hyper_util::rt::TokioIo;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::{TcpStream, UnixStream},
};

use super::ListenAddr;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connecting to {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("talking to {addr}: {source}")]
    Http { addr: String, source: hyper::Error },
    #[error("{addr} did not answer within {timeout:?}")]
    Timeout { addr: String, timeout: Duration },
    #[error("bad request for {0}")]
    Request(String),
}

/// `GET path` from the agent at `addr`: the status and the body.
pub async fn get(addr: &ListenAddr, path: &str) -> Result<(StatusCode, Bytes), ClientError> {
    const TIMEOUT: Duration = Duration::from_secs(30);
    let shown = addr.to_string();
    let exchange = async {
        match addr {
            ListenAddr::Tcp(socket) => {
                exchange(
                    TcpStream::connect(socket),
                    &socket.to_string(),
                    path,
                    &shown,
                )
                .await
            }
            ListenAddr::Unix(socket) => {
                exchange(UnixStream::connect(socket), "localhost", path, &shown).await
            }
        }
    };
    tokio::time::timeout(TIMEOUT, exchange)
        .await
        .map_err(|_| ClientError::Timeout {
            addr: shown.clone(),
            timeout: TIMEOUT,
        })?
}

/// Connects with `connect` and sends the request for `path`.
async fn exchange<S>(
    connect: impl Future<Output = std::io::Result<S>>,
    host: &str,
    path: &str,
    shown: &str,
) -> Result<(StatusCode, Bytes), ClientError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let stream = connect.await.map_err(|source| ClientError::Connect {
        addr: shown.to_owned(),
        source,
    })?;
    let http = |source| ClientError::Http {
        addr: shown.to_owned(),
        source,
    };
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(http)?;
    let connection = tokio::spawn(connection);
    let request = Request::get(path)
        .header(HOST, host)
        .body(http_body_util::Empty::<Bytes>::new())
        .map_err(|_| ClientError::Request(path.to_owned()))?;
    let response = sender.send_request(request).await.map_err(http)?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(http)?
        .to_bytes();
    connection.abort();
    Ok((status, body))
}
