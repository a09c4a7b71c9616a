"""The fault campaign (tests/node/campaign.py) against three replicas on PostgreSQL: the
nemesis also pauses, restarts and partitions PostgreSQL."""

from campaign import run_campaign


def test_a_campaign_on_postgresql_loses_nothing_and_sends_nothing_after_deletion(
        cluster, images, postgres_server, replicas):
    run_campaign(cluster, images, replicas, postgres_server)
