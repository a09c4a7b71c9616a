//! Fair admission of publishes: each namespace may have at most so many publishes waiting
//! for the store at once. The store commits one group at a time, so without a bound one
//! producer's flood would queue ahead of every other namespace's publishes (and of the
//! deliveries' claims and records). Over the bound a publish is refused at once with
//! 429 and Retry-After, before anything is written; the producer tries again. Pure
//! bookkeeping.

use std::collections::HashMap;

#[derive(Debug)]
pub struct Admission {
    limit: u32,
    in_progress: HashMap<String, u32>,
}

impl Admission {
    pub fn new(limit: u32) -> Self {
        Self {
            limit: limit.max(1),
            in_progress: HashMap::new(),
        }
    }

    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Admits one publish into `namespace`, or refuses it when the namespace already has
    /// `limit` in progress. Every admitted publish must be [`Admission::leave`]n.
    pub fn enter(&mut self, namespace: &str) -> bool {
        let n = self.in_progress.entry(namespace.to_string()).or_default();
        if *n >= self.limit {
            return false;
        }
        *n += 1;
        true
    }

    pub fn leave(&mut self, namespace: &str) {
        if let Some(n) = self.in_progress.get_mut(namespace) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.in_progress.remove(namespace);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flooding_namespace_is_bounded_and_others_are_not() {
        let mut a = Admission::new(2);
        assert!(a.enter("flood"));
        assert!(a.enter("flood"));
        assert!(!a.enter("flood"), "a third publish in progress is refused");
        assert!(a.enter("calm"), "another namespace is admitted meanwhile");
        a.leave("flood");
        assert!(a.enter("flood"), "a finished publish frees its place");
        assert!(!a.enter("flood"));
        a.leave("flood");
        a.leave("flood");
        a.leave("calm");
        assert!(
            a.in_progress.is_empty(),
            "nothing is kept for idle namespaces"
        );
    }
}
