//! `kubectl herald`: the herald binary installed as `kubectl-herald` on PATH. A client of
//! the aggregated API (`delivery.herald.dev`) and of WebhookSubscriptions, with the
//! kubeconfig's credentials, as kubectl's own commands are: nothing here talks to herald
//! directly. Exit codes a script can use: 0 done, 1 refused (the answer says why), 2 bad
//! usage, 3 the API server or herald unavailable.

use std::io::Read;
use std::process::ExitCode;

use k8s_openapi::jiff;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};

use crate::aggregated::{GROUP, VERSION};
use crate::api::WebhookSubscription;
use crate::cli::{OutputFormat, PluginCommand, PluginCommon};

/// Why a command failed, and the exit code it gives.
#[derive(Debug)]
enum Failure {
    /// The API server (or herald behind it) refused: exit 1.
    Refused(String),
    /// The arguments make no request: exit 2.
    Usage(String),
    /// No answer, or a server error: exit 3.
    Unavailable(String),
}

impl From<kube::Error> for Failure {
    fn from(e: kube::Error) -> Self {
        match e {
            // Busy (429) is worth trying again later, as unavailable is.
            kube::Error::Api(status) if status.code < 500 && status.code != 429 => {
                Failure::Refused(format!(
                    "Error from server ({}): {}",
                    status.reason, status.message
                ))
            }
            other => Failure::Unavailable(format!("{other}")),
        }
    }
}

/// Runs one plugin command.
pub(crate) fn execute(command: PluginCommand) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("kubectl herald: {e}");
            return ExitCode::from(3);
        }
    };
    match runtime.block_on(run(command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Refused(message)) => {
            eprintln!("{message}");
            ExitCode::from(1)
        }
        Err(Failure::Usage(message)) => {
            eprintln!("kubectl herald: {message}");
            ExitCode::from(2)
        }
        Err(Failure::Unavailable(message)) => {
            eprintln!("kubectl herald: {message}");
            ExitCode::from(3)
        }
    }
}

/// A client from the kubeconfig (KUBECONFIG, ~/.kube/config, or in-cluster) and the
/// namespace to use.
async fn client(common: &PluginCommon) -> Result<(kube::Client, String), Failure> {
    let mut config = kube::Config::infer()
        .await
        .map_err(|e| Failure::Unavailable(format!("no usable kubeconfig: {e}")))?;
    // One try, answered within a minute: kube's default retries a 503 (herald down behind
    // the API server) for minutes; a script gets exit 3 at once and decides itself.
    config.default_retry = false;
    config.read_timeout = Some(std::time::Duration::from_secs(60));
    let client = kube::Client::try_from(config)
        .map_err(|e| Failure::Unavailable(format!("no usable kubeconfig: {e}")))?;
    let namespace = common
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_string());
    Ok((client, namespace))
}

fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, kind), plural)
}

/// Runs `call`, and again after the server's `retryAfterSeconds` while it answers 429
/// (herald's read budget, the API server's priority and fairness): nothing was done then.
/// At most five waits of at most ten seconds each; then the 429 is the answer (exit 3).
async fn patiently<T, F, Fut>(mut call: F) -> Result<T, kube::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, kube::Error>>,
{
    let mut waits = 0;
    loop {
        match call().await {
            Err(kube::Error::Api(status)) if status.code == 429 && waits < 5 => {
                waits += 1;
                let seconds = status
                    .details
                    .as_ref()
                    .map_or(1, |d| d.retry_after_seconds)
                    .clamp(1, 10);
                tokio::time::sleep(std::time::Duration::from_secs(seconds.into())).await;
            }
            answer => return answer,
        }
    }
}

/// `whsub/orders`, `webhooksubscription/orders` or `orders`.
fn subscription_name(text: &str) -> Result<String, Failure> {
    let name = match text.split_once('/') {
        None => text,
        Some((kind, name))
            if ["whsub", "webhooksubscription", "webhooksubscriptions"]
                .contains(&kind.split('.').next().unwrap_or_default()) =>
        {
            name
        }
        Some(_) => {
            return Err(Failure::Usage(format!(
                "{text:?} is not a subscription: write whsub/NAME"
            )));
        }
    };
    if name.is_empty() {
        return Err(Failure::Usage("the subscription's name is empty".into()));
    }
    Ok(name.to_string())
}

/// Prints objects as json or yaml.
fn print(output: OutputFormat, value: &Value) -> Result<(), Failure> {
    let text = match output {
        OutputFormat::Json => serde_json::to_string_pretty(value)
            .map(|t| t + "\n")
            .map_err(|e| e.to_string()),
        OutputFormat::Yaml => serde_saphyr::to_string(value).map_err(|e| e.to_string()),
    }
    .map_err(Failure::Unavailable)?;
    print!("{text}");
    Ok(())
}

/// Prints rows under a header, each column as wide as its widest cell (as kubectl does).
fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let line = |cells: Vec<&str>| {
        let text: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        println!("{}", text.join("   ").trim_end());
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

async fn run(command: PluginCommand) -> Result<(), Failure> {
    match command {
        PluginCommand::Publish(args) => {
            let data: Option<Value> = match args.data.as_deref() {
                None => None,
                Some(text) => {
                    let text = match text.strip_prefix('@') {
                        Some("-") => {
                            let mut read = String::new();
                            std::io::stdin().read_to_string(&mut read).map_err(|e| {
                                Failure::Usage(format!("reading standard input: {e}"))
                            })?;
                            read
                        }
                        Some(path) => std::fs::read_to_string(path)
                            .map_err(|e| Failure::Usage(format!("reading {path}: {e}")))?,
                        None => text.to_string(),
                    };
                    Some(
                        serde_json::from_str(&text)
                            .map_err(|e| Failure::Usage(format!("--data is not JSON: {e}")))?,
                    )
                }
            };
            let (client, namespace) = client(&args.common).await?;
            let resource = resource("WebhookEvent", "webhookevents");
            let events: Api<DynamicObject> = Api::namespaced_with(client, &namespace, &resource);
            let mut object = DynamicObject::new(args.id.as_deref().unwrap_or_default(), &resource);
            if args.id.is_none() {
                object.metadata.name = None;
                object.metadata.generate_name = Some("evt-".into());
            }
            object.data = json!({"spec": {"type": args.event_type, "data": data}});
            let post = PostParams::default();
            match patiently(|| events.create(&post, &object)).await {
                Ok(created) => match args.common.output {
                    Some(output) => {
                        print(output, &serde_json::to_value(&created).unwrap_or_default())
                    }
                    None => {
                        let matched = created.data["status"]["matched"].as_u64().unwrap_or(0);
                        println!(
                            "webhookevent/{} published in {namespace}: {matched} deliveries",
                            created.metadata.name.unwrap_or_default()
                        );
                        Ok(())
                    }
                },
                // Publishing is idempotent by id: a repeat is done already.
                Err(kube::Error::Api(status)) if status.reason == "AlreadyExists" => {
                    println!(
                        "webhookevent/{} was published before in {namespace}: nothing delivered again",
                        args.id.unwrap_or_default()
                    );
                    Ok(())
                }
                Err(e) => Err(e.into()),
            }
        }
        PluginCommand::Deliveries(args) => {
            let subscription = subscription_name(&args.subscription)?;
            let mut fields = format!("subscription={subscription}");
            if let Some(outcome) = &args.outcome {
                fields.push_str(&format!(",outcome={outcome}"));
            }
            if let Some(state) = &args.state {
                fields.push_str(&format!(",state={state}"));
            }
            let (client, namespace) = client(&args.common).await?;
            let deliveries: Api<DynamicObject> =
                Api::namespaced_with(client, &namespace, &resource("Delivery", "deliveries"));
            let params = ListParams::default()
                .fields(&fields)
                .limit(args.limit.clamp(1, 1000));
            let list = patiently(|| deliveries.list(&params)).await?;
            if let Some(output) = args.common.output {
                let items: Vec<Value> = list
                    .items
                    .iter()
                    .map(|o| serde_json::to_value(o).unwrap_or_default())
                    .collect();
                return print(
                    output,
                    &json!({"apiVersion": format!("{GROUP}/{VERSION}"), "kind": "DeliveryList", "items": items}),
                );
            }
            let rows: Vec<Vec<String>> = list
                .items
                .iter()
                .map(|o| {
                    let field = |name: &str| match &o.data[name] {
                        Value::String(s) => s.clone(),
                        Value::Null => String::new(),
                        other => other.to_string(),
                    };
                    vec![
                        o.metadata
                            .creation_timestamp
                            .as_ref()
                            .map(|t| t.0.to_string())
                            .unwrap_or_default(),
                        field("eventId"),
                        field("eventType"),
                        field("outcome"),
                        field("statusCode"),
                        format!("{}ms", field("latencyMs")),
                    ]
                })
                .collect();
            table(
                &["TIME", "EVENT", "TYPE", "OUTCOME", "STATUS", "LATENCY"],
                &rows,
            );
            Ok(())
        }
        PluginCommand::Replay(args) => {
            let subscription = subscription_name(&args.subscription)?;
            let since = args.since.as_deref().map(since).transpose()?;
            let (client, namespace) = client(&args.common).await?;
            let resource = resource("Replay", "replays");
            let replays: Api<DynamicObject> = Api::namespaced_with(client, &namespace, &resource);
            let mut object = DynamicObject::new("", &resource);
            object.metadata.name = None;
            object.metadata.generate_name = Some(format!("{subscription}-"));
            let mut spec = json!({"subscription": subscription});
            if let Some(since) = since {
                spec["since"] = since.into();
            }
            if !args.event_ids.is_empty() {
                spec["eventIds"] = json!(args.event_ids);
            }
            object.data = json!({"spec": spec});
            let post = PostParams::default();
            let created = patiently(|| replays.create(&post, &object)).await?;
            match args.common.output {
                Some(output) => print(output, &serde_json::to_value(&created).unwrap_or_default()),
                None => {
                    let replayed = created.data["status"]["replayed"].as_u64().unwrap_or(0);
                    println!("whsub/{subscription}: {replayed} dead letters due again");
                    Ok(())
                }
            }
        }
        PluginCommand::Enable(args) => {
            let subscription = subscription_name(&args.subscription)?;
            let (client, namespace) = client(&args.common).await?;
            let resource = resource("Enablement", "enablements");
            let enablements: Api<DynamicObject> =
                Api::namespaced_with(client, &namespace, &resource);
            let mut object = DynamicObject::new("", &resource);
            object.metadata.name = None;
            object.metadata.generate_name = Some(format!("{subscription}-"));
            object.data = json!({"spec": {"subscription": subscription}});
            let post = PostParams::default();
            let created = patiently(|| enablements.create(&post, &object)).await?;
            match args.common.output {
                Some(output) => print(output, &serde_json::to_value(&created).unwrap_or_default()),
                None => {
                    println!("whsub/{subscription} enabled");
                    Ok(())
                }
            }
        }
        PluginCommand::Status(args) => {
            let (client, namespace) = client(&args.common).await?;
            let subscriptions: Api<WebhookSubscription> = Api::namespaced(client, &namespace);
            let all = ListParams::default();
            let list = patiently(|| subscriptions.list(&all)).await?;
            if let Some(output) = args.common.output {
                let items: Vec<Value> = list
                    .items
                    .iter()
                    .map(|s| json!({"name": s.metadata.name, "status": s.status}))
                    .collect();
                return print(
                    output,
                    &json!({"namespace": namespace, "subscriptions": items}),
                );
            }
            let rows: Vec<Vec<String>> = list
                .items
                .iter()
                .map(|s| {
                    let status = s.status.clone().unwrap_or_default();
                    let ready = status
                        .conditions
                        .iter()
                        .find(|c| c.type_ == "Ready")
                        .map(|c| format!("{} {}", c.status, c.reason))
                        .unwrap_or_else(|| "Unknown".into());
                    let last = status.last_attempt.as_ref();
                    vec![
                        s.metadata.name.clone().unwrap_or_default(),
                        ready,
                        status.pending_attempts.unwrap_or(0).to_string(),
                        status.dead_attempts.unwrap_or(0).to_string(),
                        last.map(|a| match a.status_code {
                            Some(code) => format!("{code} {}", a.outcome),
                            None => a.outcome.clone(),
                        })
                        .unwrap_or_default(),
                        last.and_then(|a| a.latency_ms)
                            .map(|ms| format!("{ms}ms"))
                            .unwrap_or_default(),
                    ]
                })
                .collect();
            table(
                &["NAME", "READY", "PENDING", "DEAD", "LAST STATUS", "LATENCY"],
                &rows,
            );
            Ok(())
        }
    }
}

/// `--since`: a duration ago (30m, 1h, 2d) or an RFC 3339 time, as RFC 3339.
fn since(text: &str) -> Result<String, Failure> {
    if let Ok(time) = text.parse::<jiff::Timestamp>() {
        return Ok(time.to_string());
    }
    let (number, unit) = text.split_at(
        text.trim_end_matches(|c: char| c.is_ascii_alphabetic())
            .len(),
    );
    let number: i64 = number.parse().map_err(|_| {
        Failure::Usage(format!(
            "--since {text:?}: write 30m, 1h, 2d or an RFC 3339 time"
        ))
    })?;
    let seconds = match unit {
        "s" => number,
        "m" => number * 60,
        "h" => number * 3600,
        "d" => number * 86_400,
        _ => {
            return Err(Failure::Usage(format!(
                "--since {text:?}: the unit is s, m, h or d"
            )));
        }
    };
    let at = jiff::Timestamp::now()
        .checked_sub(jiff::SignedDuration::from_secs(seconds))
        .map_err(|e| Failure::Usage(format!("--since {text:?}: {e}")))?;
    Ok(at.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subscription_is_named_as_kubectl_names_it() {
        assert_eq!(subscription_name("whsub/orders").unwrap(), "orders");
        assert_eq!(
            subscription_name("webhooksubscriptions.herald.dev/orders").unwrap(),
            "orders"
        );
        assert_eq!(subscription_name("orders").unwrap(), "orders");
        assert!(matches!(
            subscription_name("pod/orders"),
            Err(Failure::Usage(_))
        ));
        assert!(matches!(
            subscription_name("whsub/"),
            Err(Failure::Usage(_))
        ));
    }

    #[test]
    fn since_takes_a_duration_ago_or_a_time() {
        assert_eq!(
            since("2026-12-05T10:00:00Z").unwrap(),
            "2026-12-05T10:00:00Z"
        );
        let hour_ago: jiff::Timestamp = since("1h").unwrap().parse().unwrap();
        let drift = jiff::Timestamp::now().as_second() - hour_ago.as_second() - 3600;
        assert!(drift.abs() <= 5, "{drift}");
        assert!(matches!(since("1y"), Err(Failure::Usage(_))));
        assert!(matches!(since("soon"), Err(Failure::Usage(_))));
    }
}
