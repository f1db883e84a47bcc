//! The paths each endpoint serves (introspection: the JSON views;
//! metrics: `/metrics` only), GET and HEAD only, and the replies: JSON
//! views, `{"error": ...}` for anything else.

use std::sync::Arc;

use axum::{
    Router,
    extract::Request,
    http::{
        HeaderValue, Method, StatusCode,
        header::{ALLOW, CONTENT_TYPE},
    },
    middleware::{self, Next},
    response::Response,
    routing::get,
};
use serde::Serialize;
use tracing::warn;

use super::{
    IntrospectError, METRICS_PATH, PATH_ENI_CONFIGS, PATH_IPAMD_ENV_SETTINGS,
    PATH_NETWORKUTILS_ENV_SETTINGS, PATHS,
    handlers::{self, Shared},
    views::ErrorView,
};

/// The introspection endpoint's routes.
pub(super) fn introspection(shared: Arc<Shared>) -> Router {
    let routes = Router::new()
        .route("/", get(handlers::index))
        .route("/v1", get(handlers::index))
        .route("/v1/enis", get(handlers::enis))
        .route("/v1/pods", get(handlers::pods))
        .route("/v1/policy", get(super::policy::policy))
        .route("/v1/nat", get(handlers::nat))
        .route("/v1/nat/summary", get(handlers::nat_summary))
        .route("/v1/config", get(handlers::config))
        .route(PATH_ENI_CONFIGS, get(handlers::eni_configs))
        .route(PATH_IPAMD_ENV_SETTINGS, get(handlers::ipamd_env_settings))
        .route(
            PATH_NETWORKUTILS_ENV_SETTINGS,
            get(handlers::networkutils_env_settings),
        );
    get_only(routes.fallback(no_introspection_endpoint)).with_state(shared)
}

/// The metrics endpoint's routes.
pub(super) fn metrics(shared: Arc<Shared>) -> Router {
    let routes = Router::new().route(METRICS_PATH, get(handlers::metrics));
    get_only(routes.fallback(no_metrics_endpoint)).with_state(shared)
}

/// Every path, known or not, refuses other methods than GET and HEAD.
fn get_only<S: Clone + Send + Sync + 'static>(routes: Router<S>) -> Router<S> {
    routes.layer(middleware::from_fn(refuse_other_methods))
}

async fn refuse_other_methods(request: Request, next: Next) -> Response {
    if matches!(*request.method(), Method::GET | Method::HEAD) {
        return next.run(request).await;
    }
    let mut response = error(
        StatusCode::METHOD_NOT_ALLOWED,
        &format!("{} is not served: GET only", request.method()),
    );
    response
        .headers_mut()
        .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
    response
}

async fn no_introspection_endpoint(request: Request) -> Response {
    error(
        StatusCode::NOT_FOUND,
        &format!(
            "no endpoint {}: try {}",
            request.uri().path(),
            PATHS.join(", ")
        ),
    )
}

async fn no_metrics_endpoint(request: Request) -> Response {
    error(
        StatusCode::NOT_FOUND,
        &format!(
            "no endpoint {}: metrics are at {METRICS_PATH}",
            request.uri().path()
        ),
    )
}

/// A body of `content_type`.
pub(super) fn reply(
    status: StatusCode,
    content_type: &str,
    body: impl Into<axum::body::Body>,
) -> Response {
    let mut response = Response::new(body.into());
    *response.status_mut() = status;
    if let Ok(value) = content_type.parse() {
        response.headers_mut().insert(CONTENT_TYPE, value);
    }
    response
}

/// A view as pretty JSON, a line feed after it.
pub(super) fn json(status: StatusCode, value: &impl Serialize) -> Response {
    match serde_json::to_vec_pretty(value) {
        Ok(mut body) => {
            body.push(b'\n');
            reply(status, "application/json", body)
        }
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

/// `{"error": message}`.
pub(super) fn error(status: StatusCode, message: &str) -> Response {
    json(
        status,
        &ErrorView {
            error: message.to_owned(),
        },
    )
}

/// A view, or the error that kept it from being made.
pub(super) fn answer(path: &str, view: Result<impl Serialize, IntrospectError>) -> Response {
    match view {
        Ok(view) => json(StatusCode::OK, &view),
        Err(e) => {
            warn!(path, error = %e, "introspection");
            error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::*;

    async fn ask(routes: Router, method: Method, path: &str) -> (StatusCode, Response) {
        let request = axum::http::Request::builder()
            .method(method)
            .uri(path)
            .body(Body::empty())
            .unwrap();
        let response = routes.oneshot(request).await.unwrap();
        (response.status(), response)
    }

    async fn body(response: Response) -> String {
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    /// The metrics routes' shape, with a stand-in for the scrape.
    fn metrics_routes() -> Router {
        let routes = Router::new().route(METRICS_PATH, get(|| async { "scrape" }));
        get_only(routes.fallback(no_metrics_endpoint))
    }

    #[tokio::test]
    async fn other_methods_are_refused_on_every_path() {
        for path in [METRICS_PATH, "/v1/pods"] {
            let (status, response) = ask(metrics_routes(), Method::POST, path).await;
            assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{path}");
            assert_eq!(response.headers()[ALLOW], "GET, HEAD");
            assert_eq!(
                response.headers()[CONTENT_TYPE],
                "application/json",
                "{path}"
            );
            let error: ErrorView = serde_json::from_str(&body(response).await).unwrap();
            assert_eq!(error.error, "POST is not served: GET only");
        }
    }

    #[tokio::test]
    async fn unknown_paths_say_where_to_look() {
        let (status, response) = ask(metrics_routes(), Method::GET, "/v1/pods").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let error: ErrorView = serde_json::from_str(&body(response).await).unwrap();
        assert_eq!(error.error, "no endpoint /v1/pods: metrics are at /metrics");
        let (status, response) = ask(metrics_routes(), Method::HEAD, METRICS_PATH).await;
        assert_eq!(status, StatusCode::OK);
        assert!(body(response).await.is_empty(), "HEAD has no body");
        let introspection = get_only(Router::new().fallback(no_introspection_endpoint));
        let (status, response) = ask(introspection, Method::GET, "/v2").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let error: ErrorView = serde_json::from_str(&body(response).await).unwrap();
        assert!(
            error
                .error
                .starts_with("no endpoint /v2: try /v1/enis, /v1/pods")
        );
    }
}
