-- Shards several replicas share (issue 11): each subscription's shard, the current lease
-- epoch of each shard, and every taking of one. A fenced claim succeeds only under the
-- shard's current epoch (the claim in postgres.rs holds its shard_owners row FOR SHARE, as
-- it holds the subscription row); taking a shard over makes the old holder's attempts on
-- the wire due again.

ALTER TABLE subscriptions ADD COLUMN shard INTEGER NOT NULL DEFAULT 0;
CREATE INDEX subscriptions_shard ON subscriptions (shard);

CREATE TABLE shard_owners (
    shard INTEGER PRIMARY KEY,
    holder TEXT NOT NULL,
    epoch BIGINT NOT NULL
);

CREATE TABLE shard_history (
    shard INTEGER NOT NULL,
    epoch BIGINT NOT NULL,
    holder TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    PRIMARY KEY (shard, epoch)
);
