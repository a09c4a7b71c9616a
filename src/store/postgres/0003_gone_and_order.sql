-- Delivery features of issue 25.
--
-- A subscription disabled because its receiver answered 410 Gone, rather than after
-- consecutive failures: its status says why. A re-enable clears it.
ALTER TABLE subscriptions ADD COLUMN gone BOOLEAN NOT NULL DEFAULT false;

-- spec.delivery.ordering: strict. A claim then takes only the subscription's oldest pending
-- delivery (by id, the publish order), found through deliveries_order rather than by
-- reading its whole backlog. Only a strict subscription's deliveries carry `strict` (set
-- when made, and on its waiting and dead ones when the setting changes), so the index
-- holds nothing for the others and costs their writes nothing; and claimed deliveries
-- leave it, so it holds what waits.
ALTER TABLE subscriptions ADD COLUMN strict_order BOOLEAN NOT NULL DEFAULT false;
ALTER TABLE deliveries ADD COLUMN strict BOOLEAN NOT NULL DEFAULT false;
CREATE INDEX deliveries_order ON deliveries (sub_uid, id) WHERE state = 0 AND strict;
