//! Objects of one kind by `namespace/name`, as the state keeps pods, Services and
//! EndpointSlices: a source replaces them all (a first view, a list) or changes
//! them key by key.

use std::collections::BTreeMap;

use crate::k8s::{EndpointSlice, ObjectMeta, Pod, Service};

/// An API object's metadata, by which [`Keyed`] files it.
pub(super) trait HasMeta {
    fn meta(&self) -> &ObjectMeta;
}

impl HasMeta for Pod {
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
}

impl HasMeta for Service {
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
}

impl HasMeta for EndpointSlice {
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
}

/// Objects of one kind by `namespace/name` (no namespace: `default`), each key
/// with its definitions in the source's order (a manifests directory may define
/// one twice; the first is used).
#[derive(Debug)]
pub(super) struct Keyed<T> {
    objects: BTreeMap<String, Vec<T>>,
}

impl<T> Default for Keyed<T> {
    fn default() -> Self {
        Keyed {
            objects: BTreeMap::new(),
        }
    }
}

impl<T: PartialEq + HasMeta> Keyed<T> {
    /// Replaces every object with `all` (objects without a name are left
    /// out); returns whether anything differs.
    pub(super) fn replace_all(&mut self, all: Vec<T>) -> bool {
        let mut objects: BTreeMap<String, Vec<T>> = BTreeMap::new();
        for o in all {
            let meta = o.meta();
            let Some(name) = meta.name.as_deref() else {
                continue;
            };
            let key = format!("{}/{name}", meta.namespace_or_default());
            objects.entry(key).or_default().push(o);
        }
        // A pushed-to Vec holds room for four objects: thousands of
        // one-definition keys would keep three times their size unused.
        objects.values_mut().for_each(Vec::shrink_to_fit);
        if objects == self.objects {
            return false;
        }
        self.objects = objects;
        true
    }

    /// Sets `key`'s definitions (none: gone); returns those it had (maybe
    /// none) when they differ, `None` when nothing changed.
    pub(super) fn set(&mut self, key: String, mut definitions: Vec<T>) -> Option<Vec<T>> {
        if self.get(&key) == definitions.as_slice() {
            return None;
        }
        let before = if definitions.is_empty() {
            self.objects.remove(&key)
        } else {
            definitions.shrink_to_fit();
            self.objects.insert(key, definitions)
        };
        Some(before.unwrap_or_default())
    }

    /// Takes in `all` (every object anew, when given), then `changed` (each
    /// `namespace/name` with its object now, none when gone); returns whether
    /// anything differs.
    pub(super) fn apply(&mut self, all: Option<Vec<T>>, changed: Vec<(String, Option<T>)>) -> bool {
        let mut differs = all.is_some_and(|all| self.replace_all(all));
        for (key, now) in changed {
            differs |= self.set(key, now.into_iter().collect()).is_some();
        }
        differs
    }

    /// `key`'s definitions (empty when it has none).
    pub(super) fn get(&self, key: &str) -> &[T] {
        self.objects.get(key).map_or(&[][..], Vec::as_slice)
    }

    /// Every definition, by `namespace/name`.
    pub(super) fn iter(&self) -> impl Iterator<Item = &T> {
        self.objects.values().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(ns: &str, name: &str, ip: &str) -> Service {
        serde_yaml_ng::from_str(&format!(
            "metadata: {{name: {name}, namespace: {ns}}}\nspec: {{clusterIP: {ip}}}"
        ))
        .unwrap()
    }

    /// A whole set files objects by key (twice-defined keys keep both, in
    /// order); a key set to what it has changes nothing; an empty set removes
    /// it and gives back what it had.
    #[test]
    fn replaced_whole_or_set_by_key() {
        let mut k = Keyed::default();
        let (a, a2, b) = (
            service("x", "a", "10.96.0.1"),
            service("x", "a", "10.96.0.9"),
            service("x", "b", "10.96.0.2"),
        );
        assert!(k.replace_all(vec![a.clone(), b.clone(), a2.clone()]));
        assert!(!k.replace_all(vec![a.clone(), b.clone(), a2.clone()]));
        assert_eq!(k.get("x/a"), [a.clone(), a2.clone()]);
        assert_eq!(k.set("x/b".into(), vec![b.clone()]), None);
        assert_eq!(
            k.set("x/a".into(), vec![a.clone()]),
            Some(vec![a.clone(), a2])
        );
        assert_eq!(k.set("x/b".into(), Vec::new()), Some(vec![b]));
        assert_eq!(k.iter().collect::<Vec<_>>(), [&a]);
        assert!(!k.apply(None, vec![("x/a".into(), Some(a.clone()))]));
        assert!(k.apply(None, vec![("x/a".into(), None)]));
        assert_eq!(k.iter().count(), 0);
    }
}
