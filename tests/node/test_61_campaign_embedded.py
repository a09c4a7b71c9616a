"""The fault campaign (tests/node/campaign.py) against one replica on the embedded store, as
the chart installs herald by default."""

from campaign import run_campaign


def test_a_campaign_on_the_embedded_store_loses_nothing_and_sends_nothing_after_deletion(
        cluster, images, embedded):
    run_campaign(cluster, images, embedded)
