-- Publishes are written in one statement, committed without a transaction block of their
-- own (one round trip, not three). What a batch claimed with its publishes is kept here
-- under the batch's key, in the same statement, so that when its answer is lost (the
-- connection broke, the time ran out) the claims can still be found and given back; and a
-- give-back that finds no row writes the key itself, so that the statement, should it
-- still arrive, fails on the key rather than claim what nobody would send. A batch that
-- claimed nothing writes no row. Rows of answered batches are deleted by later statements;
-- the few a give-back writes, with the history.
CREATE TABLE publish_claims (
    batch BIGINT PRIMARY KEY,
    at_ms BIGINT NOT NULL,
    deliveries BIGINT[] NOT NULL
);
