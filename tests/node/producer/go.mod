module herald.test/node/producer

go 1.26.0
