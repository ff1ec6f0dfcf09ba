"""savings per step: findings carry the replayed saving per step and the GPU time freed; traces keep their
steps and the combined prediction

Revision ID: 0002
Revises: 0001
"""
from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade():
    with op.batch_alter_table('findings', schema=None) as batch_op:
        batch_op.alter_column('estimated_savings_us', new_column_name='saving_us_per_step')
        batch_op.add_column(sa.Column('gpu_time_saved_us_per_step', sa.Float(), nullable=False,
                                      server_default='0'))
    with op.batch_alter_table('traces', schema=None) as batch_op:
        batch_op.add_column(sa.Column('steps', sa.JSON(), nullable=False, server_default='{}'))
        batch_op.add_column(sa.Column('prediction', sa.JSON(), nullable=False, server_default='{}'))


def downgrade():
    with op.batch_alter_table('traces', schema=None) as batch_op:
        batch_op.drop_column('prediction')
        batch_op.drop_column('steps')
    with op.batch_alter_table('findings', schema=None) as batch_op:
        batch_op.drop_column('gpu_time_saved_us_per_step')
        batch_op.alter_column('saving_us_per_step', new_column_name='estimated_savings_us')
