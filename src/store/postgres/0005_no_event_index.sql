-- Deliveries are no longer indexed by their event. Every claim and every record writes a
-- new version of the delivery's row (its state is in the lane index, so no update is HOT),
-- and each version added an entry to every index: this one was a third of that work and
-- served only the purge, which already reads the whole table for finished deliveries and
-- now finds events left without deliveries in the same kind of pass.
DROP INDEX IF EXISTS deliveries_event;
