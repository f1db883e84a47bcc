//! The XML EC2 answers with: `<{Action}Response>` in the 2016-11-15
//! namespace with a `requestId`, lists as `<xxxSet><item>`, timestamps in
//! ISO 8601 with milliseconds, and errors as
//! `<Response><Errors><Error><Code>`... (the shape the SDK's
//! `ec2_query_errors` parser reads).

use std::fmt::{Display, Write};

/// The namespace of every EC2 response.
pub const EC2_NAMESPACE: &str = "http://ec2.amazonaws.com/doc/2016-11-15/";

/// Builds one response document.
#[derive(Debug)]
pub struct Xml {
    out: String,
}

impl Xml {
    /// Opens `<{action}Response>` with its `requestId`.
    pub fn response(action: &str, request_id: &str) -> Self {
        let mut out = String::with_capacity(1024);
        let _ = write!(
            out,
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<{action}Response xmlns=\"{EC2_NAMESPACE}\"><requestId>{request_id}</requestId>"
        );
        Self { out }
    }

    /// Closes the document.
    pub fn finish(mut self, action: &str) -> String {
        let _ = write!(self.out, "</{action}Response>");
        self.out
    }

    /// `<tag>value</tag>`, escaped.
    pub fn leaf(&mut self, tag: &str, value: impl Display) -> &mut Self {
        let _ = write!(self.out, "<{tag}>");
        escape_into(&mut self.out, &value.to_string());
        let _ = write!(self.out, "</{tag}>");
        self
    }

    /// Bare text, escaped (a list of plain values: `<item>ebs</item>`).
    pub fn text(&mut self, text: &str) -> &mut Self {
        escape_into(&mut self.out, text);
        self
    }

    /// `<tag>value</tag>` when there is a value.
    pub fn opt_leaf(&mut self, tag: &str, value: Option<impl Display>) -> &mut Self {
        if let Some(value) = value {
            self.leaf(tag, value);
        }
        self
    }

    /// `<tag>...</tag>` with `f` writing the inside.
    pub fn el(&mut self, tag: &str, f: impl FnOnce(&mut Self)) -> &mut Self {
        let _ = write!(self.out, "<{tag}>");
        f(self);
        let _ = write!(self.out, "</{tag}>");
        self
    }

    /// `<tag><item>...</item>...</tag>`: an EC2 list.
    pub fn set<T>(
        &mut self,
        tag: &str,
        items: impl IntoIterator<Item = T>,
        mut f: impl FnMut(&mut Self, T),
    ) -> &mut Self {
        let _ = write!(self.out, "<{tag}>");
        for item in items {
            self.out.push_str("<item>");
            f(self, item);
            self.out.push_str("</item>");
        }
        let _ = write!(self.out, "</{tag}>");
        self
    }

    /// `<tagSet>` from key/value pairs.
    pub fn tags<'a>(
        &mut self,
        tags: impl IntoIterator<Item = (&'a String, &'a String)>,
    ) -> &mut Self {
        self.set("tagSet", tags, |x, (key, value)| {
            x.leaf("key", key).leaf("value", value);
        })
    }
}

/// An error document, as EC2 sends it.
pub fn error_document(code: &str, message: &str, request_id: &str) -> String {
    let mut out =
        String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Response><Errors><Error><Code>");
    escape_into(&mut out, code);
    out.push_str("</Code><Message>");
    escape_into(&mut out, message);
    let _ = write!(
        out,
        "</Message></Error></Errors><RequestID>{request_id}</RequestID></Response>"
    );
    out
}

fn escape_into(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
}

/// Milliseconds since the Unix epoch as EC2 writes them:
/// `2024-05-01T12:34:56.789Z`.
pub fn timestamp(ms: u64) -> String {
    let secs = ms / 1000;
    let days = i64::try_from(secs / 86_400).expect("small");
    let rem = secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// ISO 8601 without milliseconds, as IMDS and Kubernetes write times:
/// `2024-05-01T12:34:56Z`.
pub fn timestamp_secs(ms: u64) -> String {
    let mut text = timestamp(ms - ms % 1000);
    // "...:56.000Z" -> "...:56Z"
    text.truncate(text.len() - 5);
    text.push('Z');
    text
}

/// Howard Hinnant's `civil_from_days`: days since 1970-01-01 to a date.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = u32::try_from(doy - (153 * mp + 2) / 5 + 1).expect("1..=31");
    let month = u32::try_from(if mp < 10 { mp + 3 } else { mp - 9 }).expect("1..=12");
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        assert_eq!(timestamp(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(timestamp(1_709_251_199_123), "2024-02-29T23:59:59.123Z");
        assert_eq!(timestamp(951_782_400_000), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn escapes_and_nests() {
        let mut xml = Xml::response("CreateTags", "r1");
        xml.leaf("return", "a<b&c");
        xml.tags([(&"k".to_owned(), &"v".to_owned())]);
        let doc = xml.finish("CreateTags");
        assert!(doc.contains("<return>a&lt;b&amp;c</return>"));
        assert!(doc.contains("<tagSet><item><key>k</key><value>v</value></item></tagSet>"));
        assert!(doc.ends_with("</CreateTagsResponse>"));
        let err = error_document("InvalidAction", "x", "r2");
        assert!(err.contains("<Code>InvalidAction</Code>"));
    }
}
