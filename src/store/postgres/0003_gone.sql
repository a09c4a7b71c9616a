-- A subscription disabled because its receiver answered 410 Gone (issue 25), rather than
-- after consecutive failures: its status says why. A re-enable clears it.

ALTER TABLE subscriptions ADD COLUMN gone BOOLEAN NOT NULL DEFAULT false;
