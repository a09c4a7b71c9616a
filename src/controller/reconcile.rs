//! Reconciling one `WebhookSubscription`: read its secrets, hand the engine what it should
//! run, act on a re-enable request, then let the status writer show the result. Deletion
//! goes through kube-runtime's finalizer helper: the engine's purge-and-fence runs before
//! the finalizer `herald.dev/purge` comes off, so the object cannot vanish while attempts for
//! it could still start.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::{Resource, ResourceExt};

use super::conditions::{Announcement, Problem, REENABLE_ANNOTATION, reenable_requested};
use super::secret_reads::SecretReads;
use super::status::{Entry, StatusWriter};
use super::{Error, Result};
use crate::api::subscription::{SecretLookup, SecretProblem};
use crate::api::{WebhookSubscription, WebhookSubscriptionSpec};
use crate::delivery::{Engine, SubscriptionConfig};

/// The finalizer that holds a subscription until its pending attempts are purged.
pub const FINALIZER: &str = "herald.dev/purge";

pub struct Context {
    pub client: kube::Client,
    pub engine: Arc<Engine>,
    pub status: Arc<StatusWriter>,
    pub secrets: SecretReads,
}

pub async fn reconcile(obj: Arc<WebhookSubscription>, ctx: Arc<Context>) -> Result<Action> {
    let metrics = crate::metrics::get();
    let timer = metrics.reconcile_duration.start_timer();
    let result = reconcile_finalized(obj, ctx).await;
    timer.observe_duration();
    let label = if result.is_ok() { "ok" } else { "error" };
    metrics.reconciles.with_label_values(&[label]).inc();
    result
}

async fn reconcile_finalized(obj: Arc<WebhookSubscription>, ctx: Arc<Context>) -> Result<Action> {
    let namespace = obj
        .namespace()
        .ok_or(Error::Invalid("object without namespace"))?;
    let api: Api<WebhookSubscription> = Api::namespaced(ctx.client.clone(), &namespace);
    finalizer(&api, FINALIZER, obj, |event| async {
        match event {
            Finalizer::Apply(obj) => apply(&obj, &ctx).await,
            Finalizer::Cleanup(obj) => cleanup(&obj, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

/// What a reconcile reads from the object besides its spec's generation: deletion,
/// finalizers and the re-enable annotation. A watch event that changes none of it (herald's
/// own status write) is not reconciled.
pub fn reconcile_digest(obj: &WebhookSubscription) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    obj.meta().generation.hash(&mut hasher);
    obj.meta().deletion_timestamp.is_some().hash(&mut hasher);
    obj.finalizers().hash(&mut hasher);
    obj.annotations().get(REENABLE_ANNOTATION).hash(&mut hasher);
    hasher.finish()
}

async fn apply(obj: &WebhookSubscription, ctx: &Context) -> Result<Action> {
    let uid = obj.uid().ok_or(Error::Invalid("object without uid"))?;
    let namespace = obj.namespace().unwrap_or_default();
    let name = obj.name_any();
    let known = ctx.status.entry(&uid);
    let [shared_uid, shared_namespace, shared_name] = ctx.status.identity(&uid, &namespace, &name);

    let secrets = resolve_secrets(ctx, &namespace, &obj.spec).await?;
    let unreadable = secrets.as_ref().err().map(|p| format!("{p:?}"));
    let digest = crate::delivery::config_digest(
        &obj.spec,
        secrets
            .as_deref()
            .map_err(|_| unreadable.as_deref().unwrap_or_default()),
    );
    let (config, mut problem) = match SubscriptionConfig::from_spec(
        shared_uid.clone(),
        shared_namespace.clone(),
        shared_name.clone(),
        &obj.spec,
        secrets.clone().map_err(|p| format!("{p:?}")),
    ) {
        Ok(config) => {
            let problem = match (&secrets, &config.not_ready) {
                (Err(p), _) => Some(p.clone()),
                (Ok(_), Some(why)) => Some(Problem::InvalidSecret(
                    why.trim_start_matches("signing secret unusable: ")
                        .to_string(),
                )),
                (Ok(_), None) => None,
            };
            (Some(config), problem)
        }
        Err(why) => (None, Some(Problem::InvalidSpec(why))),
    };
    let mut applied = known.as_ref().and_then(|k| k.applied);
    if let Some(config) = config
        && applied != Some(digest)
    {
        let state = ctx.engine.upsert(config).await?;
        if !state.live {
            // The store tombstoned this uid: it was deleted. Nothing to run.
            problem = Some(Problem::InvalidSpec(
                "this subscription was deleted; its object is going away".into(),
            ));
        }
        applied = Some(digest);
    }

    let handled = known
        .as_ref()
        .and_then(|k| k.reenable_handled.clone())
        .or_else(|| {
            let shown = known.as_ref()?.shown.as_ref()?;
            shown.reenable_handled.clone()
        });
    let annotation = obj
        .annotations()
        .get(REENABLE_ANNOTATION)
        .map(String::as_str);
    let mut reenabled = false;
    let handled = match reenable_requested(annotation, handled.as_deref()) {
        Some(value) => {
            let was_disabled = ctx
                .engine
                .store()
                .subscription_state(&uid)
                .await?
                .is_some_and(|s| s.disabled);
            if was_disabled {
                ctx.engine.enable(&namespace, &name).await?;
                reenabled = true;
            }
            Some(Box::from(value))
        }
        None => handled,
    };

    ctx.status.observe(
        shared_uid,
        Entry {
            namespace: shared_namespace,
            name: shared_name,
            generation: obj.meta().generation,
            paused: obj.spec.paused,
            disable_after: obj.spec.disable_after_consecutive_failures,
            problem: problem.map(Box::new),
            reenable_handled: handled.clone(),
            secrets: obj
                .spec
                .secret_refs()
                .map(|r| Box::from(r.name.as_str()))
                .collect(),
            applied,
            reconciled: Some(reconcile_digest(obj)),
            ..Default::default()
        },
    );
    if reenabled {
        ctx.status
            .announce(
                &namespace,
                &name,
                &uid,
                Announcement {
                    warning: false,
                    reason: "Reenabled",
                    note: format!(
                        "re-enabled by the {REENABLE_ANNOTATION} annotation ({}); attempts start again",
                        handled.unwrap_or_default()
                    ),
                },
            )
            .await;
    }
    ctx.status.write(&uid).await?;
    // No periodic requeue (the queue does not read the Action): the object and the Secrets
    // it names are watched, and a watch that breaks is listed again, which brings every
    // changed object back.
    Ok(Action::await_change())
}

async fn cleanup(obj: &WebhookSubscription, ctx: &Context) -> Result<Action> {
    let uid = obj.uid().ok_or(Error::Invalid("object without uid"))?;
    let namespace = obj.namespace().unwrap_or_default();
    let name = obj.name_any();
    let purged = ctx.engine.remove(&namespace, &uid).await?;
    tracing::info!(namespace = %namespace, subscription = %name, purged, "subscription deleted; its pending attempts are purged");
    ctx.status
        .announce(
            &namespace,
            &name,
            &uid,
            Announcement {
                warning: false,
                reason: "Purged",
                note: format!(
                    "purged {purged} pending attempts; no attempt for this subscription starts again"
                ),
            },
        )
        .await;
    ctx.status.forget(&uid);
    Ok(Action::await_change())
}

/// The subscription's secret values, current first, or the problem that stops them being
/// read. An API error (the API server is away) is an error of the reconcile, retried; it
/// never becomes a status.
async fn resolve_secrets(
    ctx: &Context,
    namespace: &str,
    spec: &WebhookSubscriptionSpec,
) -> Result<std::result::Result<Vec<String>, Problem>> {
    // Before any request: the name goes into the read's path (an object stored before the
    // schema checked names could hold "?watch=true…" and turn the read into a watch).
    if let Some(why) = spec.secret_ref_problem() {
        return Ok(Err(Problem::InvalidSpec(why)));
    }
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), namespace);
    let mut read = std::collections::HashMap::new();
    for reference in spec.secret_refs() {
        if read.contains_key(reference.name.as_str()) {
            continue;
        }
        let fetch = async {
            let secret = api.get_opt(&reference.name).await?;
            Ok(secret.map(|s| Arc::new(s.data.unwrap_or_default())))
        };
        let data = ctx.secrets.read(namespace, &reference.name, fetch).await?;
        read.insert(reference.name.as_str(), data);
    }
    let values = spec.secret_values(|name, key| match read.get(name).and_then(Option::as_ref) {
        None => SecretLookup::NoSecret,
        Some(data) => data
            .get(key)
            .map_or(SecretLookup::NoKey, |bytes| SecretLookup::Value(&bytes.0)),
    });
    Ok(values.map_err(|problem| match problem {
        SecretProblem::InvalidRef(why) => Problem::InvalidSpec(why),
        SecretProblem::NotFound(name) => Problem::SecretNotFound(name),
        SecretProblem::KeyMissing(name, key) => Problem::SecretKeyMissing(name, key),
        not_text @ SecretProblem::NotText(..) => {
            Problem::InvalidSecret(not_text.message(namespace))
        }
    }))
}
