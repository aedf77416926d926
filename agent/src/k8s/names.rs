//! Kubernetes' syntax for object names and labels, as its API server validates
//! them (`k8s.io/apimachinery/pkg/util/validation`, described in
//! <https://kubernetes.io/docs/concepts/overview/working-with-objects/names/> and
//! <https://kubernetes.io/docs/concepts/overview/working-with-objects/labels/#syntax-and-character-set>).
//!
//! Manifests and authorization policies are checked with these, so that what the
//! agent accepts is what a cluster would accept.

/// Which syntax a kind of object's name follows (Pods, EndpointSlices and most
/// others: a DNS-1123 subdomain; Namespaces: a DNS-1123 label; Services: a
/// DNS-1035 label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameRule {
    /// [`is_dns1123_label`].
    Dns1123Label,
    /// [`is_dns1123_subdomain`].
    Dns1123Subdomain,
    /// [`is_dns1035_label`].
    Dns1035Label,
}

impl NameRule {
    /// Whether `name` follows the rule.
    pub fn accepts(self, name: &str) -> bool {
        match self {
            NameRule::Dns1123Label => is_dns1123_label(name),
            NameRule::Dns1123Subdomain => is_dns1123_subdomain(name),
            NameRule::Dns1035Label => is_dns1035_label(name),
        }
    }

    /// The rule as errors name it ("DNS-1123 subdomain").
    pub fn describe(self) -> &'static str {
        match self {
            NameRule::Dns1123Label => "DNS-1123 label",
            NameRule::Dns1123Subdomain => "DNS-1123 subdomain",
            NameRule::Dns1035Label => "DNS-1035 label",
        }
    }
}

/// A DNS-1123 label (RFC 1123 as Kubernetes applies it): 1 to 63 lowercase letters,
/// digits and `-`, starting and ending with a letter or digit. Namespaces are
/// labels.
pub fn is_dns1123_label(s: &str) -> bool {
    s.len() <= 63 && is_dns1123_part(s)
}

/// A DNS-1035 label (RFC 1035): 1 to 63 lowercase letters, digits and `-`,
/// starting with a letter and ending with a letter or digit. Service names are
/// DNS-1035 labels.
pub fn is_dns1035_label(s: &str) -> bool {
    is_dns1123_label(s) && s.as_bytes()[0].is_ascii_lowercase()
}

/// A DNS-1123 subdomain: up to 253 characters of dot-separated parts, each of
/// lowercase letters, digits and `-`, starting and ending with a letter or digit.
/// Kubernetes limits only the total length, not each part's. Pod, service account,
/// node and policy names are subdomains, as is a label key's prefix.
pub fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns1123_part)
}

fn is_dns1123_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

/// The name part of a label key, or a non-empty label value: 1 to 63 letters
/// (either case), digits, `-`, `_` and `.`, starting and ending with a letter or
/// digit.
fn is_label_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// A label key (Kubernetes' "qualified name"): an optional DNS-1123 subdomain
/// prefix and `/`, then a label name.
pub fn is_label_key(key: &str) -> bool {
    match key.split_once('/') {
        Some((prefix, name)) => is_dns1123_subdomain(prefix) && is_label_name(name),
        None => is_label_name(key),
    }
}

/// A label value: empty, or a label name.
pub fn is_label_value(value: &str) -> bool {
    value.is_empty() || is_label_name(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns1123_labels() {
        for good in ["a", "web-1", "0", &"a".repeat(63)] {
            assert!(is_dns1123_label(good), "{good:?}");
        }
        for bad in ["", "-a", "a-", "A", "a.b", "a_b", "wéb", &"a".repeat(64)] {
            assert!(!is_dns1123_label(bad), "{bad:?}");
        }
    }

    #[test]
    fn dns1035_labels_start_with_a_letter() {
        for good in ["a", "web-1", &"a".repeat(63)] {
            assert!(is_dns1035_label(good), "{good:?}");
        }
        for bad in ["", "1web", "-a", "a-", "a.b", "Web", &"a".repeat(64)] {
            assert!(!is_dns1035_label(bad), "{bad:?}");
        }
    }

    #[test]
    fn dns1123_subdomains_limit_only_the_total_length() {
        let long_part = format!("{}.example", "a".repeat(100));
        for good in ["a", "web-1.ns.svc", &long_part, &"a".repeat(253)] {
            assert!(is_dns1123_subdomain(good), "{good:?}");
        }
        for bad in [
            "",
            ".",
            "a.",
            ".a",
            "a..b",
            "a.-b",
            "A.b",
            "a/b",
            &"a".repeat(254),
        ] {
            assert!(!is_dns1123_subdomain(bad), "{bad:?}");
        }
    }

    #[test]
    fn label_keys_and_values() {
        for key in ["app", "App_1.x-y", "example.com/app", "k8s.io/Name"] {
            assert!(is_label_key(key), "{key:?}");
        }
        let long_prefix = format!("{}.example.com/app", "a".repeat(100));
        assert!(is_label_key(&long_prefix));
        for key in [
            "",
            "/app",
            "example.com/",
            "a/b/c",
            "-app",
            "app-",
            "Example.com/app",
        ] {
            assert!(!is_label_key(key), "{key:?}");
        }
        assert!(!is_label_key(&"a".repeat(64)));
        assert!(!is_label_key(&format!("{}/app", "a".repeat(254))));
        for value in ["", "web", "Web_1.x-y", &"v".repeat(63)] {
            assert!(is_label_value(value), "{value:?}");
        }
        for value in ["web_", ".web", "a b", "wéb", &"v".repeat(64)] {
            assert!(!is_label_value(value), "{value:?}");
        }
    }
}
