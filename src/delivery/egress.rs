//! The egress guard: by default herald refuses to deliver to loopback, private, CGNAT,
//! link-local (cloud metadata included), multicast, unspecified and other special-purpose
//! addresses, in IPv4, IPv6 and IPv4-embedded IPv6 forms, and to the cluster's own pod and
//! service ranges when it is told them (on IPv6 clusters they are often global addresses).
//! It checks every resolved address at connect time (so a hostname that resolves to a
//! private address, DNS rebinding included, is refused too) and IP-literal URLs before
//! sending. Redirects are never followed, so there is no second destination to check. An
//! allow-list of CIDRs opens it.
//!
//! What a refused *name* resolved to goes to herald's log only: the attempt's message, which
//! the tenant reads, says the same for a refused name as for one that does not resolve, so
//! herald is no DNS oracle for the cluster's private names.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use ipnet::IpNet;

#[derive(Clone, Debug, Default)]
pub struct EgressPolicy {
    allow: Vec<IpNet>,
    /// The cluster's pod and service ranges (`--cluster-cidr`), refused like private ones.
    cluster: Vec<IpNet>,
}

const CLUSTER_CATEGORY: &str = "cluster network (--cluster-cidr)";

#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
#[error("egress refused: {ip} is a {category} address (open it with --egress-allow)")]
pub struct Refused {
    pub ip: IpAddr,
    pub category: &'static str,
}

impl EgressPolicy {
    pub fn new(allow: Vec<IpNet>) -> Self {
        Self {
            allow,
            cluster: Vec::new(),
        }
    }

    /// Also refuses the cluster's pod and service ranges (unless the allow-list opens them).
    pub fn with_cluster_ranges(mut self, cluster: Vec<IpNet>) -> Self {
        self.cluster = cluster;
        self
    }

    /// Ok when herald may connect to `ip`. An IPv6 address that carries an IPv4 one is
    /// refused when either is: the translator on the way delivers to the IPv4 address.
    pub fn check(&self, ip: IpAddr) -> Result<(), Refused> {
        let ip = canonical(ip);
        if self.allowed(ip) {
            return Ok(());
        }
        self.check_one(ip)?;
        if let IpAddr::V6(v6) = ip {
            for v4 in embedded_ipv4(v6) {
                // 0.0.0.0/8 is no translator's destination: it is what the other positions
                // read where the prefix is longer than the position assumes.
                if v4.octets()[0] != 0 {
                    self.check_one(IpAddr::V4(v4))?;
                }
            }
        }
        Ok(())
    }

    fn check_one(&self, ip: IpAddr) -> Result<(), Refused> {
        let category = special_category(ip).or_else(|| {
            self.cluster
                .iter()
                .any(|net| net.contains(&ip))
                .then_some(CLUSTER_CATEGORY)
        });
        match category {
            Some(category) if !self.allowed(ip) => Err(Refused { ip, category }),
            _ => Ok(()),
        }
    }

    fn allowed(&self, ip: IpAddr) -> bool {
        self.allow.iter().any(|net| net.contains(&ip))
    }
}

fn v4_at(hi: u16, lo: u16) -> Ipv4Addr {
    Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo))
}

/// IPv4-mapped (::ffff:a.b.c.d), IPv4-compatible (::a.b.c.d), SIIT (::ffff:0:a.b.c.d) and
/// well-known NAT64 (64:ff9b::/96) addresses *are* the IPv4 address they carry.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return IpAddr::V4(v4);
            }
            let s = v6.segments();
            let embedded = v4_at(s[6], s[7]);
            if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] || s[..6] == [0, 0, 0, 0, 0xffff, 0] {
                return IpAddr::V4(embedded);
            }
            if s[..6] == [0; 6] && !v6.is_loopback() && !v6.is_unspecified() {
                return IpAddr::V4(embedded);
            }
            ip
        }
        v4 => v4,
    }
}

/// The IPv4 addresses an IPv6 address may lead to through a translator: 6to4 (2002::/16
/// carries it after the prefix) and local-use NAT64 (64:ff9b:1::/48, RFC 8215), where the
/// operator picks the prefix length, so every RFC 6052 position a /48 to /96 prefix allows
/// is judged (a false refusal can be opened with the allow-list; a false pass cannot).
fn embedded_ipv4(v6: Ipv6Addr) -> Vec<Ipv4Addr> {
    let s = v6.segments();
    match s {
        [0x2002, hi, lo, ..] => vec![v4_at(hi, lo)],
        [0x64, 0xff9b, 0x0001, ..] => {
            let b = v6.octets();
            // RFC 6052 §2.2: bits 64..71 (octet 8) are always skipped.
            vec![
                Ipv4Addr::new(b[6], b[7], b[9], b[10]),    // /48
                Ipv4Addr::new(b[7], b[9], b[10], b[11]),   // /56
                Ipv4Addr::new(b[9], b[10], b[11], b[12]),  // /64
                Ipv4Addr::new(b[12], b[13], b[14], b[15]), // /96
            ]
        }
        _ => Vec::new(),
    }
}

fn special_category(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => v4_category(v4),
        IpAddr::V6(v6) => v6_category(v6),
    }
}

fn v4_category(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    Some(match (a, b, c) {
        _ if ip.is_loopback() => "loopback",
        _ if ip.is_unspecified() || a == 0 => "unspecified",
        _ if ip.is_private() => "private (RFC 1918)",
        (100, 64..=127, _) => "shared (CGNAT, RFC 6598)",
        _ if ip.is_link_local() => "link-local (cloud metadata)",
        _ if ip.is_multicast() => "multicast",
        _ if ip.is_broadcast() => "broadcast",
        (192, 0, 0) => "IETF protocol assignment",
        (192, 0, 2) | (198, 51, 100) | (203, 0, 113) => "documentation",
        (198, 18..=19, _) => "benchmarking",
        (240..=255, _, _) => "reserved",
        _ => return None,
    })
}

fn v6_category(ip: Ipv6Addr) -> Option<&'static str> {
    let first = ip.segments()[0];
    Some(match first {
        _ if ip.is_loopback() => "loopback",
        _ if ip.is_unspecified() => "unspecified",
        0xfc00..=0xfdff => "unique local (ULA)",
        0xfe80..=0xfebf => "link-local",
        0xfec0..=0xfeff => "site-local",
        0xff00..=0xffff => "multicast",
        0x2001 if ip.segments()[1] == 0x0db8 => "documentation",
        0x0100 if ip.segments()[1..4] == [0, 0, 0] => "discard-only",
        _ => return None,
    })
}

/// reqwest's resolver with the guard in front: a name resolves only to addresses herald may
/// reach, checked when the connection is made.
#[derive(Clone, Debug)]
pub struct GuardedResolver {
    pub policy: Arc<EgressPolicy>,
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.policy.clone();
        Box::pin(async move {
            let host = name.as_str().to_string();
            // The tenant reads the attempt's message: one text whether the name does not
            // resolve or resolves only to refused addresses, so herald tells no tenant what
            // (or whether) a cluster-private name resolves. The log says which, for operators.
            let unreachable = || -> Box<dyn std::error::Error + Send + Sync> {
                format!(
                    "egress refused: {host} did not resolve to an address herald may deliver to (herald's log says why)"
                )
                .into()
            };
            let resolved: Vec<SocketAddr> = match tokio::net::lookup_host((host.as_str(), 0)).await
            {
                Ok(resolved) => resolved.collect(),
                Err(e) => {
                    tracing::info!(host = %host, error = %e, "a receiver's name did not resolve");
                    return Err(unreachable());
                }
            };
            let mut refused = None;
            let allowed: Vec<SocketAddr> = resolved
                .into_iter()
                .filter(|addr| match policy.check(addr.ip()) {
                    Ok(()) => true,
                    Err(e) => {
                        refused.get_or_insert(e);
                        false
                    }
                })
                .collect();
            if allowed.is_empty() {
                match refused {
                    Some(e) => tracing::warn!(
                        host = %host,
                        address = %e.ip,
                        category = e.category,
                        "egress refused: a receiver's name resolves only to refused addresses"
                    ),
                    None => {
                        tracing::info!(host = %host, "a receiver's name resolved to no address")
                    }
                }
                return Err(unreachable());
            }
            let addrs: reqwest::dns::Addrs = Box::new(allowed.into_iter());
            Ok(addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(policy: &EgressPolicy, ip: &str) -> Option<&'static str> {
        policy.check(ip.parse().unwrap()).err().map(|e| e.category)
    }

    #[test]
    fn special_addresses_are_refused_by_default() {
        let p = EgressPolicy::default();
        let cases = [
            ("127.0.0.1", "loopback"),
            ("127.255.0.9", "loopback"),
            ("0.0.0.0", "unspecified"),
            ("10.1.2.3", "private (RFC 1918)"),
            ("172.16.0.1", "private (RFC 1918)"),
            ("172.31.255.255", "private (RFC 1918)"),
            ("192.168.1.1", "private (RFC 1918)"),
            ("100.64.0.1", "shared (CGNAT, RFC 6598)"),
            ("100.127.255.254", "shared (CGNAT, RFC 6598)"),
            ("169.254.169.254", "link-local (cloud metadata)"),
            ("224.0.0.1", "multicast"),
            ("255.255.255.255", "broadcast"),
            ("240.0.0.1", "reserved"),
            ("198.18.0.1", "benchmarking"),
            ("::1", "loopback"),
            ("::", "unspecified"),
            ("fd00:ec2::254", "unique local (ULA)"),
            ("fc00::1", "unique local (ULA)"),
            ("fe80::1", "link-local"),
            ("ff02::1", "multicast"),
            ("::ffff:127.0.0.1", "loopback"),
            ("::ffff:10.0.0.1", "private (RFC 1918)"),
            ("::ffff:169.254.169.254", "link-local (cloud metadata)"),
            ("::127.0.0.1", "loopback"),
            ("64:ff9b::a00:1", "private (RFC 1918)"),
            ("64:ff9b::7f00:1", "loopback"),
            // SIIT (::ffff:0:0:0/96), 6to4 (2002::/16), local-use NAT64 (64:ff9b:1::/48)
            ("::ffff:0:7f00:1", "loopback"),
            ("::ffff:0:a00:1", "private (RFC 1918)"),
            ("2002:7f00:1::", "loopback"),
            ("2002:a9fe:a9fe::1", "link-local (cloud metadata)"),
            ("64:ff9b:1::a00:1", "private (RFC 1918)"),
            ("64:ff9b:1::a9fe:a9fe", "link-local (cloud metadata)"),
            // the /48 and /64 positions of RFC 6052 (octet 8 skipped)
            ("64:ff9b:1:a00:0:100::", "private (RFC 1918)"),
            ("64:ff9b:1:0:7f:0:1::", "loopback"),
        ];
        for (ip, category) in cases {
            assert_eq!(refused(&p, ip), Some(category), "{ip}");
        }
    }

    #[test]
    fn public_addresses_pass() {
        let p = EgressPolicy::default();
        for ip in [
            "93.184.216.34",
            "8.8.8.8",
            "172.32.0.1",
            "100.128.0.1",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "::ffff:0:808:808",
            "2002:808:808::1",
            "64:ff9b:1::808:808",
        ] {
            assert_eq!(refused(&p, ip), None, "{ip}");
        }
    }

    #[test]
    fn the_allow_list_opens_exactly_its_ranges() {
        let p = EgressPolicy::new(vec![
            "127.0.0.0/8".parse().unwrap(),
            "10.1.0.0/16".parse().unwrap(),
        ]);
        assert_eq!(refused(&p, "127.0.0.1"), None);
        assert_eq!(
            refused(&p, "::ffff:127.0.0.1"),
            None,
            "mapped form follows its IPv4 address"
        );
        assert_eq!(refused(&p, "10.1.9.9"), None);
        assert_eq!(refused(&p, "10.2.0.1"), Some("private (RFC 1918)"));
        assert_eq!(refused(&p, "::1"), Some("loopback"));
        assert_eq!(
            refused(&p, "169.254.169.254"),
            Some("link-local (cloud metadata)")
        );
    }

    #[test]
    fn cluster_ranges_are_refused_when_given() {
        let range: IpNet = "2600:1f00::/32".parse().unwrap();
        assert_eq!(refused(&EgressPolicy::default(), "2600:1f00::17"), None);
        let p = EgressPolicy::default().with_cluster_ranges(vec![range]);
        assert_eq!(refused(&p, "2600:1f00::17"), Some(CLUSTER_CATEGORY));
        assert_eq!(refused(&p, "2600:1f01::17"), None);
        let opened = EgressPolicy::new(vec!["2600:1f00:5::/48".parse().unwrap()])
            .with_cluster_ranges(vec![range]);
        assert_eq!(refused(&opened, "2600:1f00:5::1"), None);
        assert_eq!(refused(&opened, "2600:1f00:6::1"), Some(CLUSTER_CATEGORY));
    }

    #[tokio::test]
    async fn a_name_that_resolves_to_loopback_is_refused() {
        use reqwest::dns::Resolve;
        let resolver = GuardedResolver {
            policy: Arc::new(EgressPolicy::default()),
        };
        let err = match resolver.resolve("localhost".parse().unwrap()).await {
            Ok(_) => panic!("localhost resolved although loopback is not allowed"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("egress refused"), "{err}");
        for revealing in ["127.0.0.1", "::1", "loopback"] {
            assert!(
                !err.contains(revealing),
                "the tenant learns what the name resolved to: {err}"
            );
        }
        let open = GuardedResolver {
            policy: Arc::new(EgressPolicy::new(vec![
                "127.0.0.0/8".parse().unwrap(),
                "::1/128".parse().unwrap(),
            ])),
        };
        assert!(open.resolve("localhost".parse().unwrap()).await.is_ok());
    }
}
